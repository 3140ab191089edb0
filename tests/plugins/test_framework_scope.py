"""An installed framework plugin acts only inside its own framework's processes.

Unconfigured, the veRL and NeMo-RL plugins vote their worker defaults only where ``verl`` or
``nemo_rl`` is imported; in any other process (a plain megatron-core job, a ModelOpt
distillation) they abstain. Each case runs in a fresh interpreter, since an earlier test may
have imported veRL into this one; ``STAND_IN`` names modules that stand in for a framework.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent.parent
PHASES = ("train", "eval", "rollout")
ROLES = (None, "ref", "teacher", "student")

SCRIPT = """
import json, os, sys, types
sys.path.insert(0, {tests!r})
for name in filter(None, os.environ.get("STAND_IN", "").split(",")):
    sys.modules[name] = types.ModuleType(name)
import torch, mtp_hooks
from mtp_hooks.demo import tiny_models
from cpu_stand_ins import install_cpu_memory_buffer
tiny_models.init_single_process(port={port})
install_cpu_memory_buffer()
model = tiny_models.build_gpt(tiny_models.TinySpec(seq_length=16, vocab_size=128))
votes = {{}}
for role in {roles!r}:
    mtp_hooks.set_role(model, role)
    for phase in {phases!r}:
        decision = mtp_hooks.decide(model, phase)
        votes[f"{{role}}.{{phase}}"] = {{
            k: decision.votes[k] for k in ("verl", "nemo", "modelopt")
        }}
mtp_hooks.set_role(model, None)
mtp_hooks.attach(model)
runs = tiny_models.MTPForwards(model)
ids = torch.randint(0, 128, (2, 16)); pos = torch.arange(16)[None].expand(2, -1)
mask = torch.triu(torch.ones(16, 16, dtype=torch.bool), 1)[None, None].expand(2, 1, 16, 16)
model.eval()
with torch.no_grad():
    model(ids, pos, mask, labels=torch.roll(ids, -1, 1))
print(json.dumps({{"votes": votes, "eval_mtp_runs": runs.n,
                  "explain": mtp_hooks.explain(model, "eval")}}))
"""


def run(stand_ins: str) -> dict:
    from ports import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("MTP_HOOKS_")}
    code = SCRIPT.format(tests=str(TESTS), port=free_port(), roles=ROLES, phases=PHASES)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**env, "STAND_IN": stand_ins},
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def outside() -> dict:
    return run("")


def test_outside_their_frameworks_unconfigured_plugins_abstain_for_every_phase_and_role(outside):
    for key, votes in outside["votes"].items():
        assert votes == {"verl": None, "nemo": None, "modelopt": None}, key


def test_outside_their_frameworks_megatron_runs_mtp_in_evaluation_as_it_would_alone(outside):
    assert outside["eval_mtp_runs"] == 1
    assert outside["explain"].endswith("result: run (decided by default)")


def test_inside_veRL_its_worker_defaults_vote_as_before():
    votes = run("verl")["votes"]
    for role in ROLES:
        for phase in PHASES:
            expected = False if role == "ref" or phase != "train" else None
            assert votes[f"{role}.{phase}"] == {"verl": expected, "nemo": None, "modelopt": None}


def test_inside_NeMo_RL_its_worker_defaults_vote_as_before():
    result = run("nemo_rl")
    for role in ROLES:
        for phase in PHASES:
            expected = None if phase == "train" else False
            assert result["votes"][f"{role}.{phase}"]["nemo"] is expected, (role, phase)
            assert result["votes"][f"{role}.{phase}"]["verl"] is None
    assert result["eval_mtp_runs"] == 0

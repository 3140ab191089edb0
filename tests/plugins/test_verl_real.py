"""mtp-hooks-verl with veRL itself (verl 0.9.1, installed without its heavy extras).

* ``import verl`` loads the ``verl.plugins`` entry point, which turns on auto-attach: a model
  built afterwards is gated with no mtp-hooks call at all.
* veRL's own ``mtp_patch.patch_postprocess`` and the plugin compose: MTP trains in the actor
  update and is skipped in ``compute_log_prob`` (which veRL runs in ``eval()`` + ``no_grad``
  with labels when ``enable_train`` is on), with gradients and log-prob outputs unchanged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mtp_hooks
import mtp_hooks_verl
from mtp_hooks.demo import tiny_models

from ports import free_port

pytest.importorskip("verl")
mtp_patch = pytest.importorskip("verl.models.mcore.mtp_patch")

TESTS = Path(__file__).resolve().parent.parent

WORKER = """
import json, sys, torch
sys.path.insert(0, {tests!r})
import verl  # loads the verl.plugins entry points, as every veRL worker process does
from mtp_hooks.demo import tiny_models
from cpu_stand_ins import install_cpu_memory_buffer
tiny_models.init_single_process(port={port})
install_cpu_memory_buffer()
model = tiny_models.build_gpt(tiny_models.TinySpec(seq_length=16, vocab_size=128))
runs = []
model.mtp.register_forward_hook(lambda *a: runs.append(1))
ids = torch.randint(0, 128, (2, 16)); pos = torch.arange(16)[None].expand(2, -1)
mask = torch.triu(torch.ones(16, 16, dtype=torch.bool), 1)[None, None].expand(2, 1, 16, 16)
model.eval()
with torch.no_grad():  # compute_log_prob, with labels as veRL passes them for MTP
    model(ids, pos, mask, labels=torch.roll(ids, -1, 1))
print(json.dumps({{"log_prob_mtp_runs": len(runs)}}))
"""


def run_worker(**env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MTP_HOOKS_")}
    code = WORKER.format(tests=str(TESTS), port=free_port())
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**base, **env}
    )


def test_import_verl_gates_models_built_afterwards_without_any_call():
    out = run_worker()
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"log_prob_mtp_runs": 0}


BEFORE_AND_AFTER = """
import json, sys, torch
sys.path.insert(0, {tests!r})
import mtp_hooks
from mtp_hooks.demo import tiny_models
from cpu_stand_ins import install_cpu_memory_buffer
tiny_models.init_single_process(port={port})
install_cpu_memory_buffer()
model = tiny_models.build_gpt(tiny_models.TinySpec(seq_length=16, vocab_size=128))
mtp_hooks.attach(model)
runs = tiny_models.MTPForwards(model)
ids = torch.randint(0, 128, (2, 16)); pos = torch.arange(16)[None].expand(2, -1)
mask = torch.triu(torch.ones(16, 16, dtype=torch.bool), 1)[None, None].expand(2, 1, 16, 16)
model.eval()
counts = []
for step in range(2):
    with torch.no_grad():
        model(ids, pos, mask, labels=torch.roll(ids, -1, 1))
    counts.append(runs.n)
    import verl  # noqa: the second forward runs in a veRL process
print(json.dumps({{"eval_mtp_runs": counts, "explain": mtp_hooks.explain(model, "eval")}}))
"""


def test_a_plain_job_keeps_mtp_until_verl_is_imported_and_then_gets_verls_defaults():
    base = {k: v for k, v in os.environ.items() if not k.startswith("MTP_HOOKS_")}
    code = BEFORE_AND_AFTER.format(tests=str(TESTS), port=free_port())
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=base)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["eval_mtp_runs"] == [1, 1]  # ran before import verl, skipped after
    assert result["explain"].endswith("result: skip (decided by verl)")


def test_mtp_hooks_auto_0_keeps_it_off():
    out = run_worker(MTP_HOOKS_AUTO="0")
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"log_prob_mtp_runs": 1}


def test_a_failure_inside_verls_plugin_loading_is_reported_loudly():
    code = (
        "import mtp_hooks\n"
        "def broken(enabled=True):\n    raise RuntimeError('no torch here')\n"
        "mtp_hooks.auto_attach = broken\n"
        "import verl\n"
        "print('verl imported')\n"
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith("MTP_HOOKS_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=base)
    assert out.returncode == 0 and "verl imported" in out.stdout
    assert "mtp-hooks-verl: auto-attach could not start (RuntimeError: no torch here)" in out.stderr


def actor_steps(build, batch, with_plugin: bool):
    """veRL's patched actor: one update step with labels, one compute_log_prob forward."""
    model = build(seed=3)
    mtp_patch.patch_postprocess(model)
    runs = tiny_models.MTPForwards(model)
    if with_plugin:
        mtp_hooks_verl.configure({"enable": True, "enable_train": True})
        mtp_hooks.attach(model)
    model.train()
    model(*batch.args(), labels=batch.labels).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    after_update = runs.n
    model.eval()
    with torch.no_grad():
        log_prob_output = model(*batch.args(), labels=batch.labels)
    return grads, log_prob_output, after_update, runs.n - after_update


def test_verls_patch_and_the_plugin_compose(build, kind, batch, only):
    if kind != "gpt":
        pytest.skip("veRL's mtp_patch patches GPTModel only")
    only("verl")
    grads, out, train_runs, log_prob_runs = actor_steps(build, batch, with_plugin=False)
    assert (train_runs, log_prob_runs) == (1, 1)  # the patch alone runs MTP in log-prob too
    mtp_hooks.testing.reset()
    only("verl")
    hooked_grads, hooked_out, train_runs, log_prob_runs = actor_steps(build, batch, True)
    assert (train_runs, log_prob_runs) == (1, 0)
    assert grads.keys() == hooked_grads.keys()
    assert all(torch.equal(grads[k], hooked_grads[k]) for k in grads)
    assert torch.equal(out, hooked_out)


def generated_trainer_config(name: str):
    from importlib.resources import files

    from omegaconf import OmegaConf

    return OmegaConf.load(str(files("verl.trainer.config") / name))


@pytest.mark.parametrize(
    "name", ["_generated_ppo_megatron_trainer.yaml", "_generated_ppo_trainer.yaml"]
)
def test_veRLs_generated_default_trainer_config_is_accepted(name, only):
    only("verl")
    mtp = generated_trainer_config(name).actor_rollout_ref.model.mtp
    assert mtp_hooks_verl.configure(mtp) == mtp_hooks_verl.VerlMTPConfig(False, False, False)
    assert mtp_hooks.decide(None, "train").votes["verl"] is False  # enable=false: never run


def test_veRLs_MtpConfig_dataclass_is_accepted(only):
    from verl.workers.config import MtpConfig

    only("verl")
    config = mtp_hooks_verl.configure(MtpConfig(enable=True, enable_train=True))
    assert (config.enable, config.enable_train, config.enable_rollout) == (True, True, False)
    assert mtp_hooks.decide(None, "train").votes["verl"] is True

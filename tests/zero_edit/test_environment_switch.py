"""MTP_HOOKS_AUTO=1 applies policies in a process that never mentions mtp-hooks.

Each test starts a fresh interpreter, as a Ray or torchrun worker would be started, with the
policy in its environment only. The start-up hook installed with the package does the rest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

LOOP = Path(__file__).with_name("plain_megatron_loop.py")


def python(code_or_script: str | Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MTP_HOOKS_")}
    args = [str(code_or_script)] if isinstance(code_or_script, Path) else ["-c", code_or_script]
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env={**base, **env}, timeout=300
    )


def loop(**env: str) -> dict:
    from ports import free_port

    out = python(LOOP, MASTER_PORT=str(free_port()), **env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_without_the_switch_megatron_runs_mtp_in_validation_too():
    pytest.importorskip("megatron.core")
    result = loop()
    assert result["mtp_forwards"] == {"train": 3, "eval": 3}


def test_with_the_switch_only_the_environment_decides():
    pytest.importorskip("megatron.core")
    result = loop(MTP_HOOKS_AUTO="1", MTP_HOOKS_POLICY="train=run,eval=skip")
    assert result["mtp_forwards"] == {"train": 3, "eval": 0}
    assert result["train_mtp_loss"] > 0


def test_train_skip_removes_the_mtp_loss():
    pytest.importorskip("megatron.core")
    result = loop(MTP_HOOKS_AUTO="1", MTP_HOOKS_POLICY="train=skip,eval=skip")
    assert result["mtp_forwards"] == {"train": 0, "eval": 0}
    assert result["train_mtp_loss"] == 0.0


PROBE = "import sys; print(sorted(m for m in ('torch', 'mtp_hooks') if m in sys.modules))"


def test_switched_off_the_start_up_hook_imports_nothing():
    out = python(PROBE)
    assert out.returncode == 0 and out.stdout.strip() == "[]"
    assert out.stderr == ""


def test_switched_on_it_waits_for_the_program_to_import_torch():
    out = python(PROBE, MTP_HOOKS_AUTO="1")
    assert out.returncode == 0 and out.stdout.strip() == "['mtp_hooks']"


def test_switched_on_it_is_on_once_torch_is_imported():
    pytest.importorskip("torch")
    code = "import torch, mtp_hooks._runtime as r; print(r.process.auto.registration is not None)"
    out = python(code, MTP_HOOKS_AUTO="1")
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr


def test_a_broken_install_warns_once_and_the_interpreter_carries_on(tmp_path):
    broken = tmp_path / "mtp_hooks"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise RuntimeError('broken on purpose')\n")
    out = python("print('still running')", MTP_HOOKS_AUTO="1", PYTHONPATH=str(tmp_path))
    assert out.returncode == 0 and out.stdout.strip() == "still running"
    warnings = [line for line in out.stderr.splitlines() if line.startswith("mtp-hooks:")]
    assert len(warnings) == 1 and "broken on purpose" in warnings[0]

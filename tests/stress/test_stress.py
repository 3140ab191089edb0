"""The lifetime, copy and many-thread scenarios, repeated under the garbage collector.

``rounds.py`` runs in an interpreter of its own under ``-X faulthandler``: a memory fault kills
only it, and its stacks show in the failure. ``MTP_HOOKS_STRESS_ROUNDS`` sets the number of
rounds (200 by default). On CPython 3.11 the gate's earlier cross-thread frame walk crashed
this within the first 100 rounds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from ports import free_port  # noqa: E402

ROUNDS = int(os.environ.get("MTP_HOOKS_STRESS_ROUNDS", "200"))


# 200 rounds take 25 s on an idle 2-core machine and about 4 min beside another test run; the
# suite's 300 s limit would fail a slow machine, not a hang, which the subprocess limit catches.
@pytest.mark.timeout(960)
def test_many_rounds_of_dropped_copied_and_threaded_models_end_cleanly():
    script = Path(__file__).with_name("rounds.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MTP_HOOKS_")}
    env["MASTER_PORT"] = str(free_port())  # rounds.py takes it
    done = subprocess.run(
        [sys.executable, "-X", "faulthandler", str(script), "--rounds", str(ROUNDS)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    assert done.stdout.strip().splitlines()[-1] == f"stress: {ROUNDS} rounds passed"

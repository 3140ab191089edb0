"""The README's main job, ``mtp-hooks demo``, on tiny real models."""

from __future__ import annotations

import os
import subprocess
import sys


def demo(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MTP_HOOKS_")}
    env["MTP_HOOKS_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "mtp_hooks", "demo", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def rows(stdout: str) -> dict[tuple[str, str], list[str]]:
    table = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) == 7 and cells[1] in ("train", "eval", "rollout"):
            table[(cells[0], cells[1])] = cells[2:6]
    return table


def test_the_default_policy_runs_mtp_in_train_only_and_says_so_from_observation():
    out = demo("--models", "gpt")
    assert out.returncode == 0, out.stderr
    assert "building a tiny gpt model" in out.stderr  # the progress line
    assert rows(out.stdout) == {
        ("GPTModel", "train"): ["run", "config", "yes", "yes"],
        ("GPTModel", "eval"): ["skip", "config", "no", "no"],
        ("GPTModel", "rollout"): ["skip", "config", "no", "no"],
    }


def test_the_policy_option_changes_what_runs():
    out = demo("--models", "gpt", "--policy", "train=skip,eval=run,rollout=skip")
    assert out.returncode == 0, out.stderr
    table = rows(out.stdout)
    assert table[("GPTModel", "train")] == ["skip", "config", "no", "no"]
    assert table[("GPTModel", "eval")][:3] == ["run", "config", "yes"]


def test_a_bad_policy_is_one_error_line_before_anything_is_built():
    out = demo("--policy", "train=sometimes")
    assert out.returncode == 2 and "building" not in out.stderr
    assert out.stderr.strip() == (
        "mtp-hooks: error: mtp_hooks.configure(): key 'train' has value 'sometimes'; "
        "allowed values are 'run', 'skip', 'auto' or 'run:WEIGHT' (e.g. 'run:0.3')"
    )

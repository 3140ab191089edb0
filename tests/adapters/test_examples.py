"""The examples run as the user guide (docs/user-guide.md) shows them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from model_fixtures import has_detach_field
from ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_examples_run_as_written_and_print_what_their_comments_say(tmp_path):
    if not has_detach_field():
        pytest.skip("the README's second example trains +detach: megatron-core 0.19 on")
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    blocks = [block for block in blocks if "@hookimpl" not in block]  # a plugin: test_docs.py
    assert len(blocks) >= 2 and "tiny_models.build_gpt" in blocks[0]
    script = tmp_path / "readme_examples.py"
    script.write_text("\n".join(blocks))  # one script, in order, as a reader runs them
    env = {k: v for k, v in os.environ.items() if not k.startswith("MTP_HOOKS_")}
    env["MTP_HOOKS_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    env["MASTER_PORT"] = str(free_port())  # beside this run's own process group
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=240
    )
    assert out.returncode == 0, out.stderr[-3000:]
    said = re.findall(r"^print\(.*\)\s+# (.*)$", "\n".join(blocks), flags=re.M)
    printed = out.stdout.splitlines()
    assert printed[0] == said[0]  # the stats, exactly
    # An untrained drafter of a 128-token vocabulary agrees with the trunk by chance alone,
    # about once in 128 positions: far below one accepted draft per step.
    assert "near 0 untrained" in said[1]
    assert 0.0 <= float(printed[1]) < 0.25


def test_the_drafter_loop_skips_mtp_once_it_drafts_well_and_trains_it_detached_after_a_shift():
    from megatron.core.transformer.transformer_config import TransformerConfig

    if "mtp_detach_heads" not in TransformerConfig.__dataclass_fields__:
        pytest.skip("+detach needs megatron-core 0.19 (mtp_detach_heads)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MTP_HOOKS_")}
    env["MTP_HOOKS_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "keep_the_drafter_fresh.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=280,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("step")]
    before, after = lines[:3], lines[3:5]
    assert all(line.endswith("train MTP skipped") for line in before), lines
    assert any(line.endswith("weight 0.3, detached") for line in after), lines
    assert lines[-1].endswith("train MTP skipped"), lines  # caught up again
    assert "'detached': " in out.stdout
    # the user guide shows what it prints: every line it quotes, as printed
    guide = (ROOT / "docs" / "user-guide.md").read_text()
    quoted = re.search(r"It prints \(.*?\n```text\n(.*?)```", guide, flags=re.S)
    assert quoted is not None
    shown = [line for line in quoted.group(1).splitlines() if line != "..."]
    assert shown and all(line in out.stdout.splitlines() for line in shown), shown

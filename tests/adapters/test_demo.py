"""The README's main job, ``mtp-hooks demo``, on tiny real models."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from mtp_hooks.demo import tiny_models

from model_fixtures import has_hybrid


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
            table[(cells[0], cells[1])] = cells[2:7]
    return table


def test_the_default_policy_skips_eval_and_rollout_measures_training_and_says_so_from_observation():
    out = demo("--models", "gpt")
    assert out.returncode == 0, out.stderr
    assert "building a tiny GPTModel" in out.stderr  # the progress line
    table = rows(out.stdout)
    train_row = table[("GPTModel", "train")]
    assert train_row[:4] == ["run", "config", "yes", "yes"]
    assert re.fullmatch(r"loss \d+\.\d\d, accepted \d+\.\d%", train_row[4])
    assert table[("GPTModel", "eval")] == ["skip", "config", "no", "no", "-"]
    assert table[("GPTModel", "rollout")] == ["skip", "config", "no", "no", "-"]
    assert "No timings" in out.stdout and " ms" not in out.stdout


def test_the_policy_option_changes_what_runs():
    out = demo("--models", "gpt", "--policy", "train=skip,eval=run,rollout=skip")
    assert out.returncode == 0, out.stderr
    table = rows(out.stdout)
    assert table[("GPTModel", "train")] == ["skip", "config", "no", "no", "-"]
    assert table[("GPTModel", "eval")] == ["run", "config", "yes", "no", "-"]


def test_a_bad_policy_is_one_error_line_before_anything_is_built():
    out = demo("--policy", "train=sometimes")
    assert out.returncode == 2 and "building" not in out.stderr
    assert out.stderr.strip() == (
        "mtp-hooks: error: mtp_hooks.configure(): key 'train' has value 'sometimes'; "
        "allowed values are 'run', 'skip', 'auto', 'run:WEIGHT' (e.g. 'run:0.3'), each of the "
        "run/auto forms optionally followed by '+metrics', '+detach', '+mask:labels' and "
        "'+objective:kl' (or ':tv', ':ce'), in any order"
    )


TEARDOWN_SCRIPT = """
import atexit, torch
from mtp_hooks.demo import tiny_models
# atexit runs last-in first-out, so this runs after whatever init_single_process registers.
atexit.register(lambda: print("initialized at exit:", torch.distributed.is_initialized()))
tiny_models.init_single_process(port=tiny_models.free_port())
torch.distributed.all_reduce(torch.ones(1))
"""


def test_a_process_group_made_by_init_single_process_is_destroyed_before_the_interpreter_ends():
    # Left to finalization, gloo's threads abort about one run in four of a finished script
    # ("terminate called without an active exception", exit status -6).
    env = {k: v for k, v in os.environ.items() if not k.startswith("MTP_HOOKS_")}
    out = subprocess.run(
        [sys.executable, "-c", TEARDOWN_SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "initialized at exit: False" in out.stdout


def test_the_nemotron_demo_without_a_gpu_says_what_it_needs_and_runs_the_rest():
    import torch

    if torch.cuda.is_available():
        return  # on a GPU it builds the model; this checks the message a CPU gets instead
    out = demo("--models", "gpt,nemotron")
    assert out.returncode == 0, out.stderr
    assert "skipping nemotron: a Nemotron-3 hybrid needs a GPU" in out.stderr
    assert "mamba-ssm" in out.stderr
    assert ("GPTModel", "train") in rows(out.stdout)


def test_a_demo_whose_every_model_is_skipped_prints_no_empty_table_and_fails():
    import torch

    if torch.cuda.is_available():
        return  # on a GPU the Nemotron-3 hybrid is built
    out = demo("--models", "nemotron")
    assert out.returncode == 1
    assert "skipping nemotron" in out.stderr and "nothing ran" in out.stderr
    assert "model | phase" not in out.stdout


def test_what_megatron_raises_in_a_row_is_printed_under_the_table_with_where_it_was_raised(build):
    import mtp_hooks
    from mtp_hooks import demo as demo_module

    model = build()
    handle = mtp_hooks.attach(model)

    def step() -> None:
        raise RuntimeError("expected all tensors to be on the same device")

    try:
        row = demo_module._measure(model, "GPTModel", handle, "train", step)
    finally:
        handle.remove()
    assert row.mtp_ran == "megatron raised RuntimeError"
    assert row.failure.startswith(
        "RuntimeError: expected all tensors to be on the same device (at "
    )
    assert "test_demo.py:" in row.failure  # the frame that raised
    assert demo_module._failures([row]) == f"GPTModel, train: {row.failure}"
    assert not model.mtp._forward_hooks  # the demo's counting hook is gone


@pytest.mark.parametrize("builder", ["build_gpt", "build_hybrid"])
def test_a_transformer_engine_model_without_transformer_engine_names_it_and_the_fix(
    megatron_cpu, builder
):
    if builder == "build_hybrid" and not has_hybrid():
        pytest.skip("HybridModel needs megatron-core 0.18+ (models/hybrid)")
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        pass
    else:
        pytest.skip("Transformer Engine imports here")
    with pytest.raises(
        ImportError, match="needs Transformer Engine, which does not import"
    ) as info:
        getattr(tiny_models, builder)(transformer_impl="transformer_engine")
    assert "pip install '.[te]'" in str(info.value) and "transformer_impl='local'" in str(
        info.value
    )


@pytest.mark.skipif(has_hybrid(), reason="this megatron-core has models/hybrid")
def test_without_models_hybrid_the_hybrid_builder_and_the_demo_name_the_release_that_has_it(
    megatron_cpu,
):
    with pytest.raises(ImportError, match="HybridModel needs megatron-core 0.18 or later"):
        tiny_models.build_hybrid()
    out = demo("--models", "hybrid")
    assert "skipping hybrid: HybridModel needs megatron-core 0.18 or later" in out.stderr
    assert "Python 3.12" in out.stderr and "No module named" not in out.stderr

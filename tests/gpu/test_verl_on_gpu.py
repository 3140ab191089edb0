"""veRL 0.9.1's own actor worker on a GPU (tests/verl_worker.py, nothing standing in but the
model source): packed (THD) batches through a Nemotron-3-shaped ``HybridModel``, which the CPU
tests cannot run (megatron's Mamba-2 layer packs only with causal-conv1d), with mtp-hooks-verl
and without it."""

from __future__ import annotations

import pytest

from verl_worker import run_in_a_process

pytest.importorskip("verl")
pytest.importorskip("causal_conv1d")


def forwards(result: dict) -> tuple[int, int]:
    (step,) = result["steps"]
    return step["mtp_forwards"]["compute_log_prob"], step["mtp_forwards"]["update_actor"]


@pytest.mark.parametrize(
    ("model", "mtp", "without", "with_plugin"),
    [
        ("nemotron", "load", (1, 1), (0, 0)),  # enable without enable_train: MTP never runs
        ("gpt", "train", (1, 1), (0, 1)),  # MTP trains in the update only
    ],
)
def test_veRLs_worker_on_a_gpu_runs_mtp_only_where_its_config_asks(
    model, mtp, without, with_plugin
):
    bare = run_in_a_process(model, mtp, "thd", plugin=False)
    hooked = run_in_a_process(model, mtp, "thd", plugin=True)
    assert (forwards(bare), forwards(hooked)) == (without, with_plugin)
    (bare_step,), (hooked_step,) = bare["steps"], hooked["steps"]
    assert hooked_step["log_probs"] == bare_step["log_probs"]
    assert hooked_step["gradients"]["update_actor"]["mtp"] == (with_plugin[1] > 0)
    assert bare_step["gradients"]["update_actor"]["mtp"] == (without[1] > 0)


def test_veRL_0_9_1_cannot_train_a_nemotron_models_mtp_on_a_gpu_either():
    for plugin in (False, True):
        with pytest.raises(AssertionError, match="doesn't match the broadcast shape"):
            run_in_a_process("nemotron", "train", "thd", plugin)

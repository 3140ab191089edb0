"""A layout whose MTP has a pipeline stage of its own, on two gloo ranks (PP=2).

Rank 0 holds the embedding, the decoder and the MTP layer; rank 1 the output layer and the
losses (``config.mtp_standalone``). Every test reads one module-scoped run with a hard timeout
(tests/distributed/_harness.py), so a stage left waiting fails instead of hanging.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import _standalone_scenarios  # noqa: E402
from _harness import run_ranks  # noqa: E402

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    results = run_ranks(
        _standalone_scenarios.standalone_stage,
        world=2,
        tp=1,
        pp=2,
        tmp=tmp_path_factory.mktemp("standalone"),
    )
    for result in results:
        assert result["ok"], result.get("traceback")
    return results


def test_the_layout_puts_mtp_on_a_stage_before_the_loss_stage(stages):
    mtp_stage, loss_stage = stages
    assert mtp_stage["mtp_process"] and not mtp_stage["post_process"]
    assert loss_stage["post_process"] and not loss_stage["mtp_process"]


def test_a_skip_on_the_mtp_stage_sends_only_the_trunks_rows_and_saves_its_mtp_forward(stages):
    mtp_stage, loss_stage = stages
    seq = _standalone_scenarios.SEQ
    assert mtp_stage["rows"] == {"plain": 2 * seq, "run": 2 * seq, "skip": seq}
    assert loss_stage["rows"] == mtp_stage["rows"]
    # plain, run, run:0, skip, eval skip, followed skip, followed run: MTP ran in four
    assert mtp_stage["mtp_forwards"] == 4
    assert mtp_stage["mtp_grads_after_skip"] == []


def test_the_loss_stage_computes_no_mtp_loss_for_a_skipped_microbatch(stages):
    loss_stage = stages[1]
    assert loss_stage["mtp_loss"]["run"] > 0 and loss_stage["mtp_loss"]["skip"] == 0


def test_a_run_equals_the_run_without_mtp_hooks_bit_for_bit_on_both_stages(stages):
    assert all(result["run_equals_plain"] for result in stages)


def test_a_skip_gives_both_stages_the_gradients_of_a_zero_mtp_loss_weight(stages):
    for result in stages:
        assert result["skip_equals_weight_zero"] and result["skip_differs_from_run"]


def test_evaluation_skips_mtp_on_the_mtp_stage_and_the_loss_stage_follows(stages):
    seq = _standalone_scenarios.SEQ
    assert [result["eval_rows"] for result in stages] == [seq, seq]
    assert stages[0]["stats"]["eval"] == stages[1]["stats"]["eval"] == {"skip": 1}


def test_the_loss_stage_follows_what_the_mtp_stage_did_whatever_its_own_policy_says(stages):
    mtp_stage, loss_stage = stages
    assert loss_stage["followed"]["skip"] == 0 and loss_stage["followed"]["run"] > 0
    assert loss_stage["followed_skip_equals_skip"] and loss_stage["followed_run_equals_run"]
    # each stage counts what it did: three training runs and two skips on both
    for stage in stages:
        assert {k: stage["stats"]["train"][k] for k in ("run", "skip")} == {"run": 3, "skip": 2}


def test_metrics_are_refused_on_both_stages_of_a_standalone_layout(stages):
    for result in stages:
        assert "mtp_standalone" in result["metrics_refused"]
        assert "+metrics" in result["metrics_refused"]

"""Two gloo ranks with TP=2 (or CP=2) on real GPTModels: agreement works, disagreement is
caught, and MTP loss masks reach each rank's MTP as megatron's own.

Every test spawns its ranks with a hard timeout (tests/distributed/_harness.py), so a
collective that one rank never joins fails the test instead of hanging it.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import _scenarios  # noqa: E402
from _harness import run_ranks  # noqa: E402
from model_fixtures import guards_empty_masks  # noqa: E402

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def agreeing(tmp_path_factory):
    return run_ranks(
        _scenarios.agreeing_policy, world=2, tp=2, tmp=tmp_path_factory.mktemp("agree")
    )


def test_tp2_ranks_that_agree_run_and_skip_without_error(agreeing):
    for result in agreeing:
        assert result["ok"], result.get("traceback")
        assert result["stats"] == {"rollout": {"skip": 1}, "train": {"run": 1}}
        assert result["mtp_forwards"] == 1


def test_tp2_skip_records_no_mtp_loss_and_keeps_the_lm_loss(agreeing):
    for result in agreeing:
        assert result["recorded_after_run"] > 0 and result["recorded_after_skip"] == 0
        assert result["losses_equal"]


def test_tp2_ranks_compute_the_same_loss(agreeing):
    assert agreeing[0]["loss_sum"] == agreeing[1]["loss_sum"]


def test_mtp_loss_logging_does_not_hang_after_an_agreed_skip(agreeing):
    assert all(r["ok"] for r in agreeing)  # track_mtp_metrics returned on both ranks


def test_a_rank_dependent_plugin_raises_decision_mismatch_on_every_rank(tmp_path):
    results = run_ranks(_scenarios.rank_dependent_plugin, world=2, tp=2, tmp=tmp_path)
    for result in results:
        assert result["ok"], result.get("traceback")
        assert result["raised"]
        assert "rank 0: run (decided by rank-dependent)" in result["message"]
        assert "rank 1: skip (decided by rank-dependent)" in result["message"]
        assert result["mtp_forwards"] == 0 and result["gates_restored"]


def test_mtp_hooks_verify_env_var_turns_verification_on(tmp_path):
    results = run_ranks(_scenarios.verify_from_env, world=2, tp=2, tmp=tmp_path)
    assert all(r["ok"] and r["raised"] for r in results), results


@pytest.fixture(scope="module")
def tp_metrics(tmp_path_factory):
    return run_ranks(
        _scenarios.metrics_under_tp, world=2, tp=2, tmp=tmp_path_factory.mktemp("metrics")
    )


def test_tp2_metrics_equal_a_whole_vocabulary_reference_on_every_rank(tp_metrics):
    for result in tp_metrics:
        assert result["ok"], result.get("traceback")
        assert 0 < result["winners_on_rank1"] < 2 * 16  # top-1 tokens come from both shards
        losses, acceptance = result["eval"]
        for depth, (loss, accepted) in enumerate(result["reference"]):
            assert losses[depth] == pytest.approx(loss, rel=1e-5)
            assert acceptance[depth] == accepted  # top-1 hits are counted exactly
        assert acceptance[0] > 0.45  # the labels were made to agree at half the positions
        reference, sampled = result["sampled"]  # the policy's probability of each draft
        assert sampled == pytest.approx(reference, rel=1e-5) and all(0 < p < 1 for p in sampled)
        walked, recorded = result["sampled_length"]  # the engine's walk over those chances
        assert recorded == pytest.approx(walked, rel=1e-5)
    assert tp_metrics[0]["eval"] == tp_metrics[1]["eval"]
    assert tp_metrics[0]["sampled_length"] == tp_metrics[1]["sampled_length"]


def test_tp2_single_position_figures_equal_megatrons_engine_one_request_at_a_time(tp_metrics):
    for result in tp_metrics:
        assert result["ok"], result.get("traceback")
        reference, recorded = result["single_position"]
        if reference is None:  # megatron-core 0.16: no compute_mtp_single_step
            assert recorded == [None, None]
            continue
        greedy, sampled = reference
        assert recorded[0] == pytest.approx(greedy, rel=1e-6) and 0 < greedy < 2
        assert recorded[1] == pytest.approx(sampled, rel=1e-4) and 0 < sampled < 2
    assert tp_metrics[0]["single_position"] == tp_metrics[1]["single_position"]


def test_tp2_metrics_equal_megatrons_own_training_log(tp_metrics):
    for result in tp_metrics:
        megatron_loss, megatron_acceptance = result["megatron"]
        losses, acceptance = result["training"]
        assert losses == megatron_loss
        if megatron_acceptance is not None:  # megatron-core 0.17+ logs acceptance
            assert acceptance == megatron_acceptance


needs_guarded_masks = pytest.mark.skipif(
    not guards_empty_masks(), reason="masks are refused where megatron divides by zero (0.16)"
)


@needs_guarded_masks
def test_tp2_a_loss_mask_block_trains_each_shard_as_megatrons_own_loss_mask(tmp_path):
    results = run_ranks(_scenarios.loss_mask_under_tp, world=2, tp=2, tmp=tmp_path)
    for result in results:
        assert result["ok"], result.get("traceback")
        assert result["grads_equal"] and result["loss_equal"] and result["lm_loss_unchanged"]
        assert result["mask_mattered"]
        assert result["stats"] == {"train": {"masked": 1, "run": 1}}


@needs_guarded_masks
def test_under_cp2_a_mask_reaches_each_ranks_mtp_as_megatrons_own_loss_mask(tmp_path):
    results = run_ranks(_scenarios.loss_mask_under_cp, world=2, tp=1, cp=2, tmp=tmp_path)
    for result in results:
        assert result["ok"], result.get("traceback")
        assert result["local_seq"] == _scenarios.SEQ // 2 and result["lm_loss_as_without_cp"]
        assert result["block_equals_loss_mask"] and result["labels_equals_loss_mask"]
        assert result["lm_loss_unchanged"] and result["mask_mattered"]
        assert result["stats"] == {
            "block": {"train": {"run": 1, "masked": 1}},
            "labels": {"train": {"run": 1, "masked": 1}},
        }


@pytest.mark.skipif(
    not __import__("model_fixtures").has_detach_field(),
    reason="kl and tv need +detach: megatron-core 0.19's mtp_detach_heads",
)
def test_tp2_each_objective_trains_each_vocabulary_shard_as_a_whole_vocabulary_reference(tmp_path):
    import _objective_scenarios

    results = run_ranks(_objective_scenarios.objective_under_tp, world=2, tp=2, tmp=tmp_path)
    for result in results:
        assert result["ok"], result.get("traceback")
        for kind in ("kl", "tv"):
            figures = result[kind]
            assert figures["sharded"] and figures["close"] and figures["trunk_as_skip"], kind
            assert figures["largest"] > 1e-6, kind


@pytest.mark.skipif(
    not __import__("model_fixtures").has_detach_field(),
    reason="kl and tv need +detach: megatron-core 0.19's mtp_detach_heads",
)
def test_under_cp2_each_ranks_objective_takes_its_targets_across_the_chunks(tmp_path):
    import _objective_scenarios

    results = run_ranks(_objective_scenarios.objective_under_cp, world=2, tp=1, cp=2, tmp=tmp_path)
    for result in results:
        assert result["ok"], result.get("traceback")
        for kind in ("kl", "tv"):
            figures = result[kind]
            assert figures["local_seq"] == _scenarios.SEQ // 2
            assert figures["carried"] == "MTPLossAutoScalerBackward" and figures["trained"]
            assert figures["want"] > 1e-4, kind
            assert abs(figures["value"] - figures["want"]) <= 1e-5 * figures["want"], figures


def test_under_cp2_the_single_position_figures_are_left_out_and_the_others_recorded(tmp_path):
    import _figure_scenarios

    results = run_ranks(
        _figure_scenarios.single_position_under_cp, world=2, tp=1, cp=2, tmp=tmp_path
    )
    for result in results:
        assert result["ok"], result.get("traceback")
        assert result["local_seq"] == _scenarios.SEQ // 2
        assert result["single"] == [None, None]
        greedy, sampled = result["others"]
        assert greedy is not None and sampled is not None and 0 < sampled < 2

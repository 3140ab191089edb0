"""A rollout engine's acceptance as MTPMetrics, fed to the controller, and the recommended depth."""

from __future__ import annotations

import math

import pytest

import mtp_hooks
from mtp_hooks import MTPMetrics, PolicyError
from mtp_hooks_drafting import (
    AcceptanceController,
    acceptance_from_counts,
    acceptance_from_megatron,
    recommend_num_speculative_tokens,
)

# What megatron-core 0.19.2's DynamicInferenceEngine logged for a rollout that drafted two
# tokens (the keys and the percent scale of its metrics dict; the counts of a real run).
MEGATRON = {
    "inference/inference_step": 41,
    "inference/step_time_s": 0.021,
    "inference/spec_decode_acceptance_rate": 94.9,
    "inference/spec_decode_tokens_proposed": 534,
    "inference/spec_decode_tokens_accepted": 507,
    "inference/spec_decode_num_steps": 267,
    "inference/spec_decode_acceptance_rate_pos1": 97.37827715355805,
    "inference/spec_decode_acceptance_rate_pos2": 92.50936329588015,
}


def test_engine_counts_become_chained_and_conditional_acceptance_and_an_accepted_length():
    m = acceptance_from_counts(267, [260, 247])
    assert m.chain_acceptance == (260 / 267, 247 / 267)
    assert m.acceptance == (260 / 267, 247 / 260)
    assert m.accepted_length == pytest.approx(507 / 267)
    assert m.tokens == (267, 267) and m.loss == () and m.forwards == 0


def test_draft_counts_may_be_given_per_position():
    m = acceptance_from_counts([10, 8], [5, 4])
    assert m.chain_acceptance == (0.5, 0.5) and m.tokens == (10, 8)


def test_megatrons_metrics_dict_gives_the_counts_it_was_computed_from():
    m = acceptance_from_megatron(MEGATRON)
    assert m.tokens == (267, 267)
    assert m.chain_acceptance == (260 / 267, 247 / 267)


def test_megatrons_keys_are_read_without_their_prefix_too():
    bare = {key.removeprefix("inference/"): value for key, value in MEGATRON.items()}
    assert acceptance_from_megatron(bare) == acceptance_from_megatron(MEGATRON)


@pytest.mark.parametrize(
    ("drop", "message"),
    [
        ("inference/spec_decode_acceptance_rate_pos1", "spec_decode_acceptance_rate_pos1"),
        ("inference/spec_decode_tokens_proposed", "spec_decode_tokens_proposed"),
    ],
)
def test_a_dict_without_speculation_figures_names_the_missing_key(drop, message):
    metrics = {k: v for k, v in MEGATRON.items() if k != drop}
    with pytest.raises(PolicyError, match=message):
        acceptance_from_megatron(metrics)


def test_a_rate_outside_percent_is_refused():
    with pytest.raises(PolicyError, match="pos2"):
        acceptance_from_megatron({**MEGATRON, "inference/spec_decode_acceptance_rate_pos2": 130})


@pytest.mark.parametrize(
    ("drafts", "accepted", "message"),
    [
        (10, [11, 0], "position 1 accepted 11 of 10"),
        (10, [3, 5], "more than position 1"),
        (-1, [0], "drafts must be an int >= 0"),
        (10, [True], r"accepted_per_position\[0\] must be an int"),
        (10, [2.5], r"accepted_per_position\[0\] must be an int"),
        ([10], [1, 1], "1 draft counts for 2 positions"),
        (10, [], "no draft positions"),
        ([], [], "no draft positions"),
        (10, "12", "must be a sequence of counts"),
        ("10", [1], "drafts must be an int or a sequence"),
    ],
)
def test_counts_that_cannot_come_from_an_engine_are_refused(drafts, accepted, message):
    with pytest.raises(PolicyError, match=message):
        acceptance_from_counts(drafts, accepted)


def test_the_engines_figures_drive_the_acceptance_controller():
    controller = AcceptanceController(target=1.5, below=0.3, above=None)
    mtp_hooks.plugins.register(controller, name="drafter")
    assert controller.update(acceptance_from_megatron(MEGATRON)) is None  # 1.90 >= 1.5: skip
    assert not mtp_hooks.decide(None, "train").run
    stale = acceptance_from_counts(267, [40, 5])
    assert controller.update(stale) == 0.3
    assert mtp_hooks.decide(None, "train").options.loss_scale == 0.3


def test_an_engine_that_drafted_nothing_leaves_the_decision_as_it_was():
    controller = AcceptanceController(target=1.5, below=0.3, above=None)
    controller.update(acceptance_from_counts(100, [90, 80]))
    assert controller.update(acceptance_from_counts(0, [0, 0])) is None
    assert controller.value == pytest.approx(1.7)


def test_a_good_drafter_drafts_every_token_it_can_and_a_stale_one_none():
    assert recommend_num_speculative_tokens([0.9, 0.8], step_cost=0.3).num_speculative_tokens == 2
    assert recommend_num_speculative_tokens([0.1, 0.0], step_cost=0.3).num_speculative_tokens == 0


def test_the_expected_speedups_follow_the_documented_formula():
    advice = recommend_num_speculative_tokens([0.6, 0.3], step_cost=[20.0, 26.0, 32.0])
    assert advice.step_cost == (1.0, 1.3, 1.6)
    assert advice.speedups == pytest.approx((1.0, 1.6 / 1.3, 1.9 / 1.6))
    assert advice.num_speculative_tokens == 1  # 1.231 > 1.1875


def test_a_tie_goes_to_the_smaller_k_and_a_k_must_beat_min_speedup():
    # k=1 and k=2 both expect 1.5x: the smaller wins.
    assert recommend_num_speculative_tokens([0.5, 0.5], step_cost=[1, 1, 4 / 3]).speedups[1:] == (
        pytest.approx(1.5),
        pytest.approx(1.5),
    )
    tie = recommend_num_speculative_tokens([0.5, 0.5], step_cost=[1.0, 1.0, 4 / 3])
    assert tie.num_speculative_tokens == 1
    assert (
        recommend_num_speculative_tokens(
            [0.5, 0.5], step_cost=[1.0, 1.0, 4 / 3], min_speedup=1.6
        ).num_speculative_tokens
        == 0
    )


def test_max_tokens_caps_the_depth_and_recorded_metrics_are_read_as_they_are():
    m = MTPMetrics(
        loss=(2.0, 2.0),
        acceptance=(0.9, 0.9),
        tokens=(9, 9),
        forwards=1,
        chain_acceptance=(0.9, 0.81),
        accepted_length=1.71,
    )
    advice = recommend_num_speculative_tokens(m, step_cost=0.1, max_tokens=1)
    assert advice.num_speculative_tokens == 1 and len(advice.speedups) == 2


def test_the_same_figures_always_give_the_same_answer():
    answers = {recommend_num_speculative_tokens([0.7, 0.4], step_cost=0.25) for _ in range(5)}
    assert len(answers) == 1


@pytest.mark.parametrize(
    ("acceptance", "step_cost", "message"),
    [
        ([1.2, 0.1], 0.2, r"acceptance\[0\]"),
        ([math.nan], 0.2, r"acceptance\[0\]"),
        ("0.5", 0.2, "sequence of fractions"),
        ([0.5, 0.4], [1.0, 1.2], "2 step costs for depths 0..2"),
        ([0.5], [1.0, 0.0], r"step_cost\[1\] must be finite and > 0"),
        ([0.5], math.inf, "step_cost must be finite"),
        ([0.5], "0.2", "step_cost must be a number"),
    ],
)
def test_bad_figures_are_refused_with_the_culprit_named(acceptance, step_cost, message):
    with pytest.raises(PolicyError, match=message):
        recommend_num_speculative_tokens(acceptance, step_cost=step_cost)


def test_megatron_rates_that_rise_with_the_position_are_refused_before_rounding_hides_it():
    rising = {
        "inference/spec_decode_acceptance_rate_pos1": 50.0,
        "inference/spec_decode_acceptance_rate_pos2": 50.4,
        "inference/spec_decode_tokens_proposed": 200,  # 100 drafts: both round to 50
    }
    with pytest.raises(PolicyError, match="pos2 .* is above pos1"):
        acceptance_from_megatron(rising)
    with pytest.raises(PolicyError, match="metrics are a dict, not list"):
        acceptance_from_megatron([("spec_decode_acceptance_rate_pos1", 50.0)])

"""AcceptanceController: the training MTP weight follows the drafter's acceptance, at update()."""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest

import mtp_hooks
from mtp_hooks import MTPMetrics, PolicyError
from mtp_hooks_drafting import AcceptanceController, DeadDrafterWarning, acceptance_from_counts


def measured(accepted_length: float, positions: int = 100, acceptance: float = 0.5):
    return mtp_hooks.MTPMetrics(
        loss=(2.0, 2.5),
        acceptance=(acceptance, acceptance / 2),
        tokens=(positions, positions - 1),
        forwards=1,
        chain_acceptance=(acceptance, acceptance / 4),
        accepted_length=accepted_length,
    )


def train_action() -> str:
    decision = mtp_hooks.decide(None, "train")
    return f"run:{decision.options.loss_scale:g}" if decision.run else "skip"


def test_a_scripted_acceptance_series_gives_the_specified_decisions():
    controller = AcceptanceController(target=1.0, below=0.3, above=None, window=2)
    mtp_hooks.plugins.register(controller, name="drafter")
    series = [0.4, 0.8, 1.6, 1.2, 0.2, 0.1]  # pooled over 2: 0.4, 0.6, 1.2, 1.4, 0.7, 0.15
    seen = [train_action()]  # before any figures: train the drafter
    for value in series:
        controller.update(measured(value))
        seen.append(train_action())
    assert seen == ["run:0.3", "run:0.3", "run:0.3", "skip", "skip", "run:0.3", "run:0.3"]
    assert (
        mtp_hooks.decide(None, "eval").run
        and mtp_hooks.decide(None, "eval").options.loss_scale is None
    )


def test_figures_are_weighted_by_positions_and_collected_between_updates():
    controller = AcceptanceController(target=1.0, below=0.3, above=0.1)
    mtp_hooks.plugins.register(controller, name="drafter")
    model = object()
    controller.mtp_metrics(model, "eval", measured(2.0, positions=100))
    controller.mtp_metrics(model, "eval", measured(0.0, positions=300))
    controller.mtp_metrics(model, "train", measured(9.0, positions=1000))  # not the watched phase
    assert train_action() == "run:0.3"  # nothing changes before update()
    assert controller.update() == 0.3 and controller.value == pytest.approx(0.5)
    controller.mtp_metrics(model, "eval", measured(1.5, positions=10))
    assert train_action() == "run:0.3"
    assert controller.update() == 0.1 and train_action() == "run:0.1"


def test_acceptance_at_a_depth_can_be_the_target_metric():
    controller = AcceptanceController(
        target=0.4, below=0.3, above=None, metric="chain_acceptance", depth=2
    )
    mtp_hooks.plugins.register(controller, name="drafter")
    controller.update(measured(0.0, acceptance=0.8))  # chain at depth 2: 0.2
    assert train_action() == "run:0.3"
    controller.update(measured(0.0, acceptance=1.0))  # 0.25 and 0.2 pooled over window 1
    assert controller.value == pytest.approx(0.25)
    with pytest.raises(mtp_hooks.PolicyError, match="depth 3 was asked for"):
        AcceptanceController(
            target=0.4, below=0.3, above=None, metric="acceptance", depth=3
        ).update(measured(1.0))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"below": -1.0}, "below must be a weight"),
        ({"above": float("inf")}, "above must be finite"),
        ({"metric": "perplexity"}, "metric must be one of"),
        ({"window": 0}, "window must be an int"),
        ({"watch": "nope"}, "unknown phase 'nope'"),
        ({"dead_below": -0.1}, "dead_below must be a finite number >= 0"),
        ({"dead_below": math.nan}, "dead_below must be a finite number >= 0"),
        ({"dead_below": True}, "dead_below must be a finite number >= 0"),
    ],
)
def test_bad_settings_are_refused_with_the_setting_named(kwargs, message):
    settings = {"target": 1.0, "below": 0.3, "above": None, **kwargs}
    with pytest.raises(mtp_hooks.PolicyError, match=message):
        AcceptanceController(**settings)


def test_the_sampled_accepted_length_drives_the_controller_from_recorded_figures_alone():
    controller = AcceptanceController(
        target=1.0, below=0.3, above=None, metric="sampled_accepted_length"
    )
    mtp_hooks.plugins.register(controller, name="drafter")
    figures = mtp_hooks.MTPMetrics(
        loss=(2.0, 2.5), acceptance=(0.9, 0.8), tokens=(100, 99), forwards=1,
        chain_acceptance=(0.9, 0.7), accepted_length=1.6,  # greedy: well above the target
        sampled_acceptance=(0.5, 0.4), sampled_chain_acceptance=(0.5, 0.2),
        sampled_accepted_length=0.7,  # sampled: below it
    )  # fmt: skip
    assert controller.update(figures) == 0.3 and controller.value == pytest.approx(0.7)
    better = dataclasses.replace(figures, sampled_accepted_length=1.2)
    assert controller.update(better) is None
    assert not mtp_hooks.decide(None, "train").run


def test_an_engines_counts_give_no_sampled_figure_and_the_controller_says_so():
    from mtp_hooks_drafting import acceptance_from_counts

    controller = AcceptanceController(
        target=1.0, below=0.3, above=None, metric="sampled_accepted_length"
    )
    engine = acceptance_from_counts([100, 100], [80, 60])
    assert engine.sampled_accepted_length is None
    with pytest.raises(mtp_hooks.PolicyError, match="record with \\+metrics, or watch"):
        controller.update(engine)
    assert controller.weight == 0.3 and controller.value is None


@pytest.mark.parametrize("target", [math.nan, math.inf, -math.inf])
def test_a_target_that_is_not_finite_is_refused(target):
    with pytest.raises(PolicyError, match="target must be finite"):
        AcceptanceController(target=target, below=0.3, above=None)


def figures(length: float, tokens: int = 100) -> MTPMetrics:
    return MTPMetrics(
        loss=(1.0,),
        acceptance=(0.5,),
        tokens=(tokens,),
        forwards=1,
        chain_acceptance=(0.5,),
        accepted_length=length,
    )


def test_a_nan_figure_never_counts_as_reaching_the_target_nor_stays_in_the_window():
    controller = AcceptanceController(target=1.5, below=0.3, above=None, window=2)
    assert controller.update(figures(math.nan)) == 0.3  # ignored: the decision stays "below"
    assert list(controller.history) == [] and controller.value is None
    controller.update(figures(1.8))
    assert controller.weight is None
    controller.update(figures(math.nan), figures(math.inf))
    assert controller.value == pytest.approx(1.8) and len(controller.history) == 1


def test_an_update_without_figures_leaves_the_window_and_the_decision_as_they_were():
    controller = AcceptanceController(target=1.5, below=0.3, above=None, window=2)
    controller.update(figures(1.0))
    controller.update()
    controller.update(figures(2.0, tokens=0))
    assert list(controller.history) == [(100.0, 100.0)] and controller.weight == 0.3


def test_a_drafter_that_accepts_almost_nothing_after_a_weight_sync_is_reported_dead_once():
    controller = AcceptanceController(target=1.5, below=0.3, above=None, window=4)
    controller.update(measured(1.8), synced=True)
    with pytest.warns(DeadDrafterWarning, match=r"accepted_length is 0\.01 .*mtp\.\* parameters"):
        controller.update(measured(0.01), synced=True)
    assert controller.dead and "dead" in repr(controller)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # told once: a second update of a dead drafter is quiet
        controller.update(measured(0.0))
    assert controller.dead
    controller.update(measured(1.2), synced=True)  # accepts again: alive, below its target
    assert not controller.dead


def test_a_sudden_fall_without_a_weight_sync_is_the_data_moving_not_a_death():
    controller = AcceptanceController(target=1.5, below=0.3, above=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        controller.update(measured(1.8))
        assert controller.update(measured(0.0)) == 0.3  # trained again, as the example shows
    assert not controller.dead


def test_a_drafter_that_never_reached_its_target_is_untrained_not_dead():
    controller = AcceptanceController(target=1.5, below=0.3, above=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for value in (0.0, 0.01, 0.02):
            controller.update(measured(value), synced=True)
    assert not controller.dead and controller.weight == 0.3


def test_a_target_below_dead_below_counts_as_reached_only_once_the_drafter_was_alive():
    controller = AcceptanceController(target=0.01, below=0.3, above=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        controller.update(measured(0.02))  # at its target, but never alive: not dead after
        controller.update(measured(0.0), synced=True)
    controller.update(measured(0.5))
    with pytest.warns(DeadDrafterWarning):
        controller.update(measured(0.0), synced=True)


def test_no_death_is_reported_with_dead_below_none():
    controller = AcceptanceController(target=1.5, below=0.3, above=None, dead_below=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        controller.update(measured(1.8), synced=True)
        controller.update(measured(0.0), synced=True)
    assert not controller.dead


def test_the_advice_follows_the_engines_counters_stale_to_no_drafting_and_refreshed_back():
    # two draft positions; a step that drafts k tokens costs 1 + 0.2 k of one that drafts none
    controller = AcceptanceController(target=1.5, below=0.3, above=None, window=2)
    controller.update(acceptance_from_counts(100, [90, 80]))
    assert controller.advise(step_cost=0.2).num_speculative_tokens == 2
    controller.update(acceptance_from_counts(100, [10, 2]))  # going stale: pooled 0.5, 0.41
    assert controller.advise(step_cost=0.2).num_speculative_tokens == 2
    controller.update(acceptance_from_counts(100, [10, 2]))  # stale over the whole window
    advice = controller.advise(step_cost=0.2)
    assert advice.num_speculative_tokens == 0 and advice.chain_acceptance == (0.1, 0.02)
    controller.update(acceptance_from_counts(100, [85, 70]))  # refreshed: pooled 0.475, 0.36
    assert controller.advise(step_cost=0.2).num_speculative_tokens == 2


def test_the_advice_pools_figures_by_their_positions_and_asks_for_figures_first():
    controller = AcceptanceController(target=1.5, below=0.3, above=None, window=3)
    with pytest.raises(mtp_hooks.PolicyError, match="no update has carried figures yet"):
        controller.advise(step_cost=0.2)
    controller.update(acceptance_from_counts(300, [150, 30]), acceptance_from_counts(100, [90, 50]))
    advice = controller.advise(step_cost=[1.0, 1.1, 1.2], max_tokens=1)
    assert advice.chain_acceptance == pytest.approx((0.6,)) and advice.num_speculative_tokens == 1

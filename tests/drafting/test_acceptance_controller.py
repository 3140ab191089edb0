"""AcceptanceController: the training MTP weight follows the drafter's acceptance, at update()."""

from __future__ import annotations

import dataclasses
import math

import pytest

import mtp_hooks
from mtp_hooks import MTPMetrics, PolicyError
from mtp_hooks_drafting import AcceptanceController


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

"""The MTP loss weight in the policy config and from plugins: syntax, validation, combination."""

from __future__ import annotations

import pytest

import mtp_hooks
from mtp_hooks.framework import loss_scale_schedule

from plugin_answers import answers


@pytest.mark.parametrize(
    "policy",
    [
        "train=run:0.3",
        "train = run: 0.3",
        {"train": "run:0.3"},
        {"train": {"mtp": "run", "loss_scale": 0.3}},
    ],
)
def test_a_weight_rides_on_run_in_every_form(policy):
    mtp_hooks.configure(policy)
    decision = mtp_hooks.decide(None, "train")
    assert (decision.run, decision.options.loss_scale, decision.options.by("loss_scale")) == (
        True,
        0.3,
        "config",
    )


def test_a_role_can_have_its_own_weight():
    mtp_hooks.configure({"train": "run:0.3", "roles": {"teacher": {"train": "run:0.1"}}})

    class Teacher:
        pass

    teacher = Teacher()
    mtp_hooks.set_role(teacher, "teacher")
    assert mtp_hooks.decide(teacher, "train").options.loss_scale == 0.1
    assert mtp_hooks.decide(None, "train").options.loss_scale == 0.3


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ("train=run:-0.1", r"key 'train'.*loss weight '-0.1' is not a finite number >= 0"),
        ("train=run:nan", "not a finite number"),
        ("train=run:inf", "not a finite number"),
        ("train=run:lots", "not a finite number"),
        ("train=skip:0.3", "allowed values are"),
        ({"train": {"mtp": "skip", "loss_scale": 0.3}}, "goes with 'run' only, not with 'skip'"),
        ({"train": {"loss_scale": 0.3}}, "a table takes 'mtp' \\(required"),
        ({"train": {"mtp": "run", "weight": 0.3}}, "a table takes 'mtp'"),
        ({"train": {"mtp": "run", "loss_scale": True}}, "not a finite number"),
        pytest.param(
            {"train": {"mtp": "run", "loss_scale": 10**400}}, "overflows a float", id="10**400"
        ),
    ],
)
def test_a_bad_weight_names_the_source_and_changes_nothing(policy, message):
    mtp_hooks.configure("train=run:0.2")
    with pytest.raises(mtp_hooks.PolicyError, match=message) as info:
        mtp_hooks.configure(policy)
    assert "mtp_hooks.configure()" in str(info.value)
    assert mtp_hooks.decide(None, "train").options.loss_scale == 0.2


@pytest.mark.parametrize(
    ("policy", "example"),
    [
        ("train=run:abc", "write e.g. 'run:0.3'"),
        ({"train": {"mtp": "run", "loss_scale": "0.3"}}, "write e.g. loss_scale = 0.3 (a number"),
    ],
)
def test_a_bad_weight_is_shown_rewritten_in_the_spelling_it_came_in(policy, example):
    with pytest.raises(mtp_hooks.PolicyError) as info:
        mtp_hooks.configure(policy)
    assert example in str(info.value)


def test_a_zero_weight_is_a_run_and_the_error_for_bad_ones_points_to_skip():
    mtp_hooks.configure("train=run:0")
    assert mtp_hooks.decide(None, "train").run is True
    with pytest.raises(mtp_hooks.PolicyError, match="use 'skip' to save the compute"):
        mtp_hooks.configure("train=run:-1")


def test_a_plugin_gives_the_weight_when_the_config_does_not():
    answers("mtp_loss_scale", 0.2, name="schedule")
    decision = mtp_hooks.decide(None, "train")
    assert (decision.options.loss_scale, decision.options.by("loss_scale")) == (0.2, "schedule")
    mtp_hooks.configure("train=run:0.3")
    assert mtp_hooks.decide(None, "train").options.by("loss_scale") == "config"


def test_a_skip_carries_no_weight():
    answers("mtp_loss_scale", 0.2, name="schedule")
    mtp_hooks.configure("eval=skip")
    assert mtp_hooks.decide(None, "eval").options.loss_scale is None


def test_plugins_that_disagree_on_the_weight_raise_a_conflict_naming_both():
    answers("mtp_loss_scale", 0.2, name="a")
    answers("mtp_loss_scale", 0.3, name="b")
    with pytest.raises(mtp_hooks.PolicyConflictError, match="a=0.2, b=0.3.*train=run:0.1"):
        mtp_hooks.decide(None, "train")


@pytest.mark.parametrize(
    ("scale", "error", "message"),
    [
        (-1.0, mtp_hooks.PolicyError, "plugin 'bad': mtp_loss_scale returned -1.0"),
        (float("nan"), mtp_hooks.PolicyError, "plugin 'bad'"),
        pytest.param(
            10**400, mtp_hooks.PolicyError, "plugin 'bad'.*overflows a float", id="10**400"
        ),
        (KeyError("step"), mtp_hooks.PluginError, "'bad': mtp_loss_scale raised KeyError"),
    ],
)
def test_a_bad_plugin_weight_names_the_plugin(scale, error, message):
    answers("mtp_loss_scale", scale, name="bad")
    with pytest.raises(error, match=message):
        mtp_hooks.decide(None, "train")


def test_explain_shows_the_weight():
    mtp_hooks.configure("train=run:0.3")
    assert "loss scale: 0.3 (from config)" in mtp_hooks.explain(None, "train")


@pytest.mark.parametrize(
    ("step", "interpolate", "weight"),
    [(0, False, 0.3), (9_999, False, 0.3), (10_000, False, 0.1), (50_000, False, 0.1)],
)
def test_a_step_schedule_holds_each_weight_until_the_next_point(step, interpolate, weight):
    assert loss_scale_schedule({0: 0.3, 10_000: 0.1}, step, interpolate=interpolate) == weight


def test_a_linear_schedule_warms_up_and_then_holds():
    points = {100: 0.0, 1_100: 0.3, 2_100: 0.1}
    weights = [loss_scale_schedule(points, s, interpolate=True) for s in (0, 600, 1_100, 1_600)]
    assert weights == pytest.approx([0.0, 0.15, 0.3, 0.2])
    assert loss_scale_schedule(points, 10**9, interpolate=True) == 0.1


@pytest.mark.parametrize(
    ("points", "message"),
    [({}, "at least one"), ({-1: 0.1}, "step -1"), ({0: -0.1}, "step 0: loss weight")],
)
def test_a_bad_schedule_is_a_clear_error(points, message):
    with pytest.raises(mtp_hooks.PolicyError, match=message):
        loss_scale_schedule(points, 0)

"""Every hook is called through pluggy, one plugin at a time, so that pluggy's tracing and
``add_hookcall_monitoring`` see each call, the plugin that answered and its answer."""

from __future__ import annotations

import pytest

import mtp_hooks
from mtp_hooks import PluginError

from plugin_answers import Model, answers


def test_monitoring_sees_each_plugins_vote_as_a_call_of_its_own(monitored):
    answers("should_run_mtp", True, name="runner")
    answers("should_run_mtp", None, name="abstainer")
    decision = mtp_hooks.decide(Model(), "eval")
    votes = sorted(call for call in monitored if call[0] == "should_run_mtp")
    assert votes == [
        ("should_run_mtp", ("abstainer",), []),
        ("should_run_mtp", ("runner",), [True]),
    ]
    assert decision.run and decision.voters == ("runner",)


@pytest.mark.parametrize(
    "hook, value, policy",
    [
        ("mtp_loss_scale", 0.25, None),
        ("mtp_detach_heads", True, None),
        ("mtp_objective", "kl", "train=run+detach"),
    ],
)
def test_monitoring_sees_the_option_hooks_of_a_decision_that_runs(monitored, hook, value, policy):
    answers(hook, value, name="answering")
    if policy:
        mtp_hooks.configure(policy)
    mtp_hooks.decide(Model(), "train")
    assert (hook, ("answering",), [value]) in monitored


def test_monitoring_sees_a_phase_declaration(monitored):
    answers("declare_phases", ["distill"], name="declares")
    mtp_hooks.decide(Model(), "distill")
    assert ("declare_phases", ("declares",), [["distill"]]) in monitored


def test_tracing_writes_a_line_per_plugin_call_naming_the_hook():
    pm = mtp_hooks.plugins.get_plugin_manager()
    lines: list[str] = []
    pm.trace.root.setwriter(lines.append)
    undo = pm.enable_tracing()
    try:
        answers("should_run_mtp", False, name="skipper")
        mtp_hooks.decide(Model(), "rollout")
    finally:
        undo()
        pm.trace.root.setwriter(None)
    assert any("should_run_mtp" in line for line in lines), lines


def test_a_plugin_that_raises_is_named_and_monitoring_sees_the_exception(monitored):
    answers("should_run_mtp", None, name="quiet")
    answers("should_run_mtp", ZeroDivisionError("boom"), name="broken")
    with pytest.raises(PluginError, match="'broken': should_run_mtp raised ZeroDivisionError"):
        mtp_hooks.decide(Model(), "train")
    raised = [call for call in monitored if call[1] == ("broken",)]
    assert len(raised) == 1 and isinstance(raised[0][2], ZeroDivisionError)


def test_a_plugin_registered_on_the_plugin_manager_directly_is_still_asked():
    answers("should_run_mtp", True, name="first")
    assert mtp_hooks.decide(Model(), "eval").voters == ("first",)
    late = answers("should_run_mtp", True)
    mtp_hooks.plugins.get_plugin_manager().register(late, name="late")
    assert mtp_hooks.decide(Model(), "eval").voters == ("first", "late")


def test_a_phase_declaration_that_raises_names_the_plugin_as_every_other_hook_does():
    answers("declare_phases", RuntimeError("no config"), name="declares")
    with pytest.raises(PluginError, match="'declares': declare_phases raised RuntimeError"):
        mtp_hooks.decide(Model(), "distill")

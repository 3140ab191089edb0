"""The combination rule: config is final when it speaks, then agreeing votes, then the default."""

from __future__ import annotations

import itertools

import pytest

import mtp_hooks
from mtp_hooks import Phase

from plugin_answers import Model


def test_with_no_config_and_no_plugins_mtp_runs_by_default():
    decision = mtp_hooks.decide(None, "eval")
    assert (decision.run, decision.decided_by, decision.votes) == (True, "default", {})


def test_a_plugin_vote_decides_and_is_named(voter):
    voter(False, "skip-eval")
    decision = mtp_hooks.decide(None, Phase.EVAL)
    assert (decision.run, decision.decided_by) == (False, "skip-eval")
    assert decision.votes == {"skip-eval": False}


def test_abstaining_plugins_leave_the_default(voter):
    voter(None, "undecided")
    decision = mtp_hooks.decide(None, "train")
    assert (decision.run, decision.decided_by) == (True, "default")
    assert decision.votes == {"undecided": None}


def test_agreeing_votes_decide_and_decided_by_lists_every_voter(voter):
    voter(False, "b-plugin")
    voter(False, "a-plugin")
    voter(None, "c-abstains")
    decision = mtp_hooks.decide(None, "rollout")
    assert decision.run is False
    assert decision.decided_by == "a-plugin,b-plugin"


def test_disagreeing_votes_raise_a_conflict_naming_each_plugin_and_the_fix(voter):
    voter(True, "wants-run")
    voter(False, "wants-skip")
    with pytest.raises(mtp_hooks.PolicyConflictError) as info:
        mtp_hooks.decide(None, "eval")
    message = str(info.value)
    assert "wants-run=run" in message and "wants-skip=skip" in message
    assert "configure('eval=run')" in message


def test_the_config_settles_a_conflict(voter):
    voter(True, "wants-run")
    voter(False, "wants-skip")
    mtp_hooks.configure("eval=skip")
    decision = mtp_hooks.decide(None, "eval")
    assert (decision.run, decision.decided_by) == (False, "config")


def test_config_is_final_and_plugins_are_not_consulted(voter):
    plugin = voter(True, "wants-run")
    mtp_hooks.configure("eval=skip")
    decision = mtp_hooks.decide(None, "eval")
    assert (decision.run, decision.decided_by, decision.source) == (
        False,
        "config",
        "mtp_hooks.configure()",
    )
    assert plugin.calls == []


def test_auto_in_the_config_defers_to_the_plugins(voter):
    voter(False, "skip-it")
    mtp_hooks.configure("eval=auto")
    assert mtp_hooks.decide(None, "eval").decided_by == "skip-it"


def test_a_role_scoped_entry_beats_the_plain_phase_entry():
    teacher, student = Model(), Model()
    mtp_hooks.set_role(teacher, "teacher")
    mtp_hooks.set_role(student, "student")
    mtp_hooks.configure("train=run,teacher.train=skip")
    assert mtp_hooks.decide(teacher, "train").run is False
    assert mtp_hooks.decide(student, "train").run is True


def test_a_role_scoped_auto_hands_that_role_to_the_plugins(voter):
    teacher = Model()
    mtp_hooks.set_role(teacher, "teacher")
    voter(True, "runs-everything")
    mtp_hooks.configure("train=skip,teacher.train=auto")
    assert mtp_hooks.decide(teacher, "train").decided_by == "runs-everything"
    assert mtp_hooks.decide(Model(), "train").decided_by == "config"


def test_plugins_receive_the_model_and_the_canonical_phase(voter):
    plugin = voter(None, "recorder")
    model = Model()
    mtp_hooks.decide(model, "rollout")
    mtp_hooks.decide(None, "train")
    assert plugin.calls == [(model, Phase.ROLLOUT), (None, Phase.TRAIN)]


def test_a_plugin_may_implement_the_hook_with_only_the_phase_argument():
    class PhaseOnly:
        @mtp_hooks.plugins.hookimpl
        def should_run_mtp(self, phase):
            return phase != Phase.ROLLOUT

    mtp_hooks.plugins.register(PhaseOnly(), name="phase-only")
    assert mtp_hooks.decide(None, "rollout").run is False


def test_a_non_bool_vote_is_an_error_naming_the_plugin():
    class SaysSkip:
        @mtp_hooks.plugins.hookimpl
        def should_run_mtp(self, model, phase):
            return "skip"

    mtp_hooks.plugins.register(SaysSkip(), name="says-skip")
    with pytest.raises(mtp_hooks.PolicyError, match="'says-skip'.*returned 'skip'"):
        mtp_hooks.decide(None, "eval")


@pytest.mark.parametrize("votes", [(True, None, True), (False, False, None), (True, False, None)])
def test_registration_order_never_changes_the_outcome(votes):
    outcomes = set()
    for order in itertools.permutations(range(len(votes))):
        mtp_hooks.testing.reset()
        for i in order:
            plugin = type(f"P{i}", (), {})()
            plugin.should_run_mtp = mtp_hooks.plugins.hookimpl(lambda model, phase, v=votes[i]: v)
            mtp_hooks.plugins.register(plugin, name=f"p{i}")
        try:
            d = mtp_hooks.decide(None, "train")
            outcomes.add((d.run, d.decided_by, tuple(d.votes.items())))
        except mtp_hooks.PolicyConflictError as exc:
            outcomes.add(("conflict", str(exc)))
    assert len(outcomes) == 1


def test_explain_reports_config_votes_and_result(voter):
    voter(False, "skip-it")
    mtp_hooks.configure("eval=run")
    text = mtp_hooks.explain(None, "eval")
    assert "config: run (from mtp_hooks.configure())" in text
    assert "plugin skip-it: skip" in text
    assert "result: run (decided by config)" in text


def test_explain_reports_a_conflict_instead_of_raising(voter):
    voter(True, "a")
    voter(False, "b")
    assert "result: CONFLICT" in mtp_hooks.explain(None, "train")


def test_trace_logs_every_decision(monkeypatch, caplog, voter):
    voter(False, "skip-it")
    monkeypatch.setenv("MTP_HOOKS_TRACE", "1")
    with caplog.at_level("INFO", logger="mtp_hooks"):
        mtp_hooks.decide(None, "eval")
    (record,) = caplog.records
    assert "phase=eval" in record.message and "decided_by=skip-it" in record.message
    assert "votes={'skip-it': False}" in record.message and "run=False" in record.message


def test_without_trace_nothing_is_logged(caplog):
    with caplog.at_level("DEBUG", logger="mtp_hooks"):
        mtp_hooks.decide(None, "eval")
    assert caplog.records == []


def test_what_decided_is_a_kind_and_a_tuple_of_voters_even_for_a_plugin_named_default(voter):
    assert mtp_hooks.decide(None, "train").kind == "default"
    voter(False, name="default")
    voter(False, name="nemo")
    decision = mtp_hooks.decide(None, "train")
    assert (decision.kind, decision.voters) == ("plugins", ("default", "nemo"))
    assert decision.decided_by == "default,nemo"  # the 0.1 display form
    mtp_hooks.configure("train=run")
    decision = mtp_hooks.decide(None, "train")
    assert (decision.kind, decision.voters, decision.decided_by) == ("config", (), "config")


def test_a_decisions_votes_are_read_only_so_a_cached_decision_cannot_be_changed(voter):
    voter(False, "alpha")
    first = mtp_hooks.decide(None, "eval")
    with pytest.raises(TypeError):
        first.votes["alpha"] = True  # type: ignore[index]
    assert mtp_hooks.decide(None, "eval").votes == {"alpha": False}
    assert dict(first.votes) == {"alpha": False}


def test_a_decision_is_built_by_keyword_only():
    with pytest.raises(TypeError):
        mtp_hooks.Decision(True, "config")  # type: ignore[misc]
    decision = mtp_hooks.Decision(run=True, kind="config")
    assert decision.votes == {} and decision.voters == ()

"""The policy in force is an immutable, versioned snapshot, and a decision is a function of a
snapshot and the plugins' answers alone."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import pytest

import mtp_hooks
from mtp_hooks import _decision, _runtime, _sources
from mtp_hooks._policy import parse_policy
from mtp_hooks._policy_snapshot import PolicySnapshot


class Ballot:
    """Answers as given, and a record of what was asked."""

    def __init__(self, votes: Mapping[str, bool | None], answers: dict[str, Any] | None = None):
        self._votes, self._answers = dict(sorted(votes.items())), answers or {}
        self.asked: list[str] = []

    def votes(self) -> Mapping[str, bool | None]:
        self.asked.append("should_run_mtp")
        return self._votes

    def implements(self, hook: str) -> bool:
        return hook in self._answers

    def answers(self, hook: str) -> list[tuple[str, Any]]:
        self.asked.append(hook)
        return list(self._answers[hook].items())


def snapshot(policy: str, version: int = 7) -> PolicySnapshot:
    return PolicySnapshot(version).advanced(entries=parse_policy(policy, "test"))


def test_the_same_snapshot_and_answers_give_the_same_decision_whatever_the_process_holds(voter):
    policy = snapshot("train=run:0.5+detach,eval=auto,teacher.eval=skip")
    before = [
        _decision.combine(policy, role, phase, Ballot({"p": False}))
        for role in (None, "teacher")
        for phase in ("train", "eval", "rollout")
    ]
    mtp_hooks.configure("train=skip,eval=run")  # the process's own policy, and a plugin
    voter(True, "in-the-registry")
    mtp_hooks.declare_phase("distill")
    after = [
        _decision.combine(policy, role, phase, Ballot({"p": False}))
        for role in (None, "teacher")
        for phase in ("train", "eval", "rollout")
    ]
    assert after == before
    train, eval_, rollout, _, teacher_eval, _ = after
    assert (train.run, train.options.loss_scale, train.options.detach) == (True, 0.5, True)
    assert (eval_.run, eval_.decided_by) == (False, "p")
    assert (rollout.run, rollout.kind) == (False, "plugins")
    assert (teacher_eval.run, teacher_eval.kind) == (False, "config")


def test_the_plugins_are_asked_only_what_the_decision_needs():
    policy = snapshot("train=run,eval=skip")
    ballot = Ballot({"p": False}, {"mtp_loss_scale": {"w": 0.25}})
    assert _decision.combine(policy, None, "eval", ballot).run is False
    assert ballot.asked == []  # the config decided a skip: no vote, no weight
    decision = _decision.combine(policy, None, "train", ballot)
    assert (decision.options.loss_scale, decision.options.by("loss_scale")) == (0.25, "w")
    assert ballot.asked == ["mtp_loss_scale"]  # the config decided the run; the weight is asked
    ballot.asked.clear()
    assert _decision.combine(policy, None, "rollout", ballot).run is False
    assert ballot.asked == ["should_run_mtp"]  # a skip by vote asks no weight


def test_a_snapshot_cannot_be_changed_in_place():
    policy = snapshot("eval=skip")
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.version = 99  # type: ignore[misc]
    with pytest.raises(TypeError):
        policy.entries[(None, "eval")] = policy.entries[(None, "eval")]  # type: ignore[index]


def test_every_change_a_decision_reads_puts_a_new_version_in_force(voter):
    seen = [_sources.refresh()]

    def changed() -> PolicySnapshot:
        current = _sources.refresh()
        assert current.version > seen[-1].version and current is not seen[-1]
        seen.append(current)
        return current

    mtp_hooks.configure("eval=skip")
    assert changed().lookup(None, "eval").value == "skip"  # type: ignore[union-attr]
    voter(False, "a-plugin")
    assert changed().entries == seen[-2].entries  # same policy, new version
    mtp_hooks.set_role(type("Model", (), {})(), "teacher")
    changed()
    mtp_hooks.declare_phase("distill")
    changed()
    mtp_hooks.testing.reset()
    assert changed().entries == {}
    assert seen[1].lookup(None, "eval").value == "skip"  # type: ignore[union-attr]  # kept whole


def test_a_broken_policy_file_is_part_of_the_snapshot_and_raised_at_every_lookup(
    tmp_path, monkeypatch
):
    path = tmp_path / "policy.toml"
    path.write_text('[policy]\neval = "skip"\n')
    monkeypatch.setenv("MTP_HOOKS_CONFIG", str(path))
    monkeypatch.setenv("MTP_HOOKS_CONFIG_POLL", "0")
    mtp_hooks.reload()
    good = _sources.refresh()
    assert good.error is None and mtp_hooks.decide(None, "eval").run is False
    path.write_text('[policy]\neval = "skp"\n')
    broken = _sources.refresh()
    assert broken.version > good.version and isinstance(broken.error, mtp_hooks.PolicyError)
    for _ in range(2):
        with pytest.raises(mtp_hooks.PolicyError, match="skp"):
            mtp_hooks.decide(None, "eval")
    assert good.lookup(None, "eval") is not None  # an older snapshot is unchanged
    path.write_text('[policy]\neval = "run"\n')
    assert _sources.refresh().error is None and mtp_hooks.decide(None, "eval").run is True


def test_the_runtime_holds_the_snapshot_that_refresh_returns():
    mtp_hooks.configure("train=skip")
    assert _sources.refresh() is _runtime.current.snapshot

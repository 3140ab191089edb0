"""A gate reuses a decision only while nothing it depends on changes.

Each test makes one forward (so the decision is cached), changes one input of the decision, and
checks that the very next forward decides anew. Plugins that vote are asked at every forward
unless each is declared ``cacheable_vote``.
"""

from __future__ import annotations

import pytest

import mtp_hooks
from mtp_hooks.demo import tiny_models
from mtp_hooks.framework import RoleSettings, cacheable_vote, votes_changed


@pytest.fixture
def model(build, batch):
    model = build()
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=run,teacher.train=skip")
    return model


def skipped(model, batch) -> bool:
    ran = tiny_models.MTPForwards(model)
    try:
        model(*batch.args(), labels=batch.labels)
    finally:
        ran.remove()
    return ran.n == 0


def test_configure_invalidates(model, batch):
    assert not skipped(model, batch)
    mtp_hooks.configure("train=skip")
    assert skipped(model, batch)


def test_reload_invalidates(model, batch, monkeypatch):
    mtp_hooks.configure(None)
    assert not skipped(model, batch)
    monkeypatch.setenv("MTP_HOOKS_POLICY", "train=skip")
    assert not skipped(model, batch)  # the environment is read at first use and by reload()
    mtp_hooks.reload()
    assert skipped(model, batch)


def test_a_file_edit_invalidates(model, batch, monkeypatch, tmp_path):
    mtp_hooks.configure(None)
    path = tmp_path / "mtp.toml"
    path.write_text('[policy]\ntrain = "run"\n')
    monkeypatch.setenv("MTP_HOOKS_CONFIG", str(path))
    monkeypatch.setenv("MTP_HOOKS_CONFIG_POLL", "0")
    mtp_hooks.reload()
    assert not skipped(model, batch)
    path.write_text('[policy]\ntrain = "skip"\n')
    assert skipped(model, batch)


def test_register_and_unregister_invalidate(model, batch, voter):
    mtp_hooks.configure(None)
    assert not skipped(model, batch)
    voter(False, "skipper")
    assert skipped(model, batch)
    mtp_hooks.plugins.unregister("skipper")
    assert not skipped(model, batch)


def test_set_role_invalidates(model, batch):
    assert not skipped(model, batch)
    mtp_hooks.set_role(model, "teacher")
    assert skipped(model, batch)


def test_a_phase_declared_after_the_first_forward_decides_at_once(model, batch):
    assert not skipped(model, batch)
    mtp_hooks.declare_phase("distill")
    mtp_hooks.configure("train=run,distill=skip")
    with mtp_hooks.phase("distill"):
        assert skipped(model, batch)
    assert not skipped(model, batch)


def test_plugins_that_vote_are_asked_at_every_forward(model, batch, voter):
    mtp_hooks.configure(None)
    counting = voter(None, "counting")
    for _ in range(3):
        model(*batch.args(), labels=batch.labels)
    assert len(counting.calls) == 3


def test_with_tracing_on_every_forward_is_logged(model, batch, monkeypatch, caplog):
    monkeypatch.setenv("MTP_HOOKS_TRACE", "1")
    mtp_hooks.reload()
    with caplog.at_level("INFO", logger="mtp_hooks"):
        for _ in range(3):
            model(*batch.args(), labels=batch.labels)
    assert sum("mtp_hooks decision" in r.getMessage() for r in caplog.records) == 3


class CacheableVoter:
    """A plugin whose vote depends only on the model and the phase, declared so."""

    def __init__(self, vote):
        self.vote = vote
        self.calls = 0

    @mtp_hooks.plugins.hookimpl
    @cacheable_vote
    def should_run_mtp(self, model, phase):
        self.calls += 1
        return self.vote(model) if callable(self.vote) else self.vote


def test_a_cacheable_vote_is_asked_once_per_phase_until_votes_change(model, batch):
    mtp_hooks.configure(None)
    plugin = CacheableVoter(False)
    mtp_hooks.plugins.register(plugin, name="cached")
    assert skipped(model, batch) and skipped(model, batch) and plugin.calls == 1
    plugin.vote = True
    votes_changed()
    assert not skipped(model, batch) and plugin.calls == 2


def test_role_settings_changes_reach_a_cacheable_vote(model, batch):
    settings = RoleSettings[bool]()
    settings.set(True)
    mtp_hooks.configure(None)
    mtp_hooks.plugins.register(CacheableVoter(lambda m: settings.get(None)), name="settings")
    assert not skipped(model, batch)
    settings.set(False)
    assert skipped(model, batch)


def test_one_plugin_that_votes_uncached_makes_every_forward_ask_them_all(model, batch, voter):
    mtp_hooks.configure(None)
    cached = CacheableVoter(None)
    mtp_hooks.plugins.register(cached, name="cached")
    model(*batch.args(), labels=batch.labels)
    uncached = voter(None, "uncached")
    for _ in range(3):
        model(*batch.args(), labels=batch.labels)
    assert cached.calls == 4 and len(uncached.calls) == 3


def test_a_cacheable_vote_is_kept_per_model(build, batch):
    first, second = build(seed=1), build(seed=2)
    mtp_hooks.attach([first, second])
    plugin = CacheableVoter(lambda m: m is first)  # run on the first model only
    mtp_hooks.plugins.register(plugin, name="per-model")
    for _ in range(2):
        assert not skipped(first, batch) and skipped(second, batch)
    assert plugin.calls == 2


def test_the_environment_is_read_at_the_first_gated_forward(build, batch, monkeypatch):
    monkeypatch.setenv("MTP_HOOKS_POLICY", "train=skip")
    model = build()
    mtp_hooks.attach(model)
    assert skipped(model, batch)


class Weight:
    def __init__(self) -> None:
        self.calls = 0

    @mtp_hooks.plugins.hookimpl
    def mtp_loss_scale(self, model, phase):
        self.calls += 1
        return 0.5


def test_a_cacheable_vote_is_asked_once_where_another_plugin_weighs_every_forward(model, batch):
    mtp_hooks.configure(None)
    voter, weight = CacheableVoter(True), Weight()
    mtp_hooks.plugins.register(voter, name="cached")
    mtp_hooks.plugins.register(weight, name="weight")
    for _ in range(3):
        assert not skipped(model, batch)
    assert (voter.calls, weight.calls) == (1, 3)  # the weight may follow the step; the vote not
    votes_changed()
    assert not skipped(model, batch) and voter.calls == 2

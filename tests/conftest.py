"""Every test starts from a fresh mtp-hooks: new plugin manager, no config, no env switches.

Entry-point autoload is off by default, so the framework plugins installed in the test
environment do not vote in tests about something else; the entry-point tests turn it back on.
"""

from __future__ import annotations

import pytest

import mtp_hooks

MTP_ENV_VARS = (
    "MTP_HOOKS_POLICY",
    "MTP_HOOKS_CONFIG",
    "MTP_HOOKS_DISABLE",
    "MTP_HOOKS_TRACE",
    "MTP_HOOKS_VERIFY",
)


@pytest.fixture(autouse=True)
def fresh_mtp_hooks(monkeypatch: pytest.MonkeyPatch):
    for name in MTP_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MTP_HOOKS_DISABLE_PLUGIN_AUTOLOAD", "1")
    mtp_hooks.reset()
    yield
    mtp_hooks.reset()


class Voter:
    """A test plugin that casts a fixed vote and counts its calls."""

    def __init__(self, vote: bool | None):
        self.vote = vote
        self.calls: list[tuple[object, object]] = []

    @mtp_hooks.hookimpl
    def should_run_mtp(self, model, phase):
        self.calls.append((model, phase))
        return self.vote


@pytest.fixture
def voter():
    """Factory: ``voter(False, name="x")`` registers a :class:`Voter` and returns it."""

    def make(vote: bool | None, name: str) -> Voter:
        plugin = Voter(vote)
        mtp_hooks.register(plugin, name=name)
        return plugin

    return make

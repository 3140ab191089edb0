"""Test plugins shared by the suites (the fresh state every test starts from is set up by the
repository's root conftest.py, which the doctests share)."""

from __future__ import annotations

import pytest

import mtp_hooks


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

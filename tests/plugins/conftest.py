"""Framework plugin tests: the plugins are pip-installed and found through their entry points.

The test sessions (``noxfile.py``) install ``plugins/*`` into the test environments. Here
autoload is back on. Every plugin's configured policy is cleared around each test by
``mtp_hooks.testing.reset()`` (the root conftest.py), since the plugins keep it in a
``RoleSettings``.
"""

from __future__ import annotations

import sys
import types

import pytest

import mtp_hooks
import mtp_hooks.framework


@pytest.fixture(autouse=True)
def autoload(monkeypatch, mtp_tracker):
    """Entry-point autoload on, and megatron's MTP loss tracker zeroed."""
    monkeypatch.delenv("MTP_HOOKS_DISABLE_PLUGIN_AUTOLOAD", raising=False)


@pytest.fixture
def only(monkeypatch):
    """``only("verl")``: block the other installed plugins, as MTP_HOOKS_DISABLE does."""

    def keep(*names: str) -> None:
        others = {"verl", "modelopt", "nemo"} - set(names)
        monkeypatch.setenv("MTP_HOOKS_DISABLE", ",".join(sorted(others)))
        mtp_hooks.testing.reset()

    return keep


@pytest.fixture
def inside(monkeypatch):
    """``inside("nemo_rl")``: this process counts as one of that framework's (a stand-in
    module where the framework is not installed), so unconfigured plugins use their worker
    defaults; the module is taken out again after the test."""

    def enter(package: str) -> None:
        monkeypatch.setitem(
            sys.modules, package, sys.modules.get(package) or types.ModuleType(package)
        )
        mtp_hooks.framework.votes_changed()

    return enter

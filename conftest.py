"""Every test, and every doctest in mtp_hooks' docstrings (``--doctest-modules mtp_hooks``),
starts from a fresh mtp-hooks: new plugin manager, no config, no env switches; and leaves none
of its state behind.

Entry-point autoload is off by default, so the framework plugins installed in the test
environment do not vote in tests about something else; the entry-point tests turn it back on.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import mtp_hooks

MTP_ENV_VARS = (  # every variable mtp_hooks and plugins/ read (tests/core/test_fresh_state.py)
    "MTP_HOOKS_POLICY",
    "MTP_HOOKS_CONFIG",
    "MTP_HOOKS_CONFIG_POLL",
    "MTP_HOOKS_DISABLE",
    "MTP_HOOKS_TRACE",
    "MTP_HOOKS_VERIFY",
    "MTP_HOOKS_AUTO",
)


@pytest.fixture(autouse=True)
def fresh_mtp_hooks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in MTP_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MTP_HOOKS_DISABLE_PLUGIN_AUTOLOAD", "1")
    mtp_hooks.testing.reset()
    yield
    mtp_hooks.testing.reset()

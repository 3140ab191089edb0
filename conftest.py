"""The doctests in mtp_hooks' docstrings (``--doctest-modules mtp_hooks``) start from a fresh
mtp-hooks and leave none of their state behind, like every test under tests/."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def fresh_for_doctests(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    if not isinstance(request.node, pytest.DoctestItem):
        yield
        return
    import mtp_hooks

    for name in ("MTP_HOOKS_POLICY", "MTP_HOOKS_CONFIG", "MTP_HOOKS_DISABLE", "MTP_HOOKS_TRACE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MTP_HOOKS_DISABLE_PLUGIN_AUTOLOAD", "1")
    mtp_hooks.reset()
    yield
    mtp_hooks.reset()

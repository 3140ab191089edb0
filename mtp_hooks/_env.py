"""How an on/off environment switch of mtp-hooks reads: ``1``, ``true``, ``yes`` or ``on``."""

from __future__ import annotations

import os

_ON = frozenset({"1", "true", "yes", "on"})


def flag(name: str) -> bool:
    """Whether the environment variable ``name`` is set to an "on" value (case-insensitive)."""
    return os.environ.get(name, "").strip().lower() in _ON

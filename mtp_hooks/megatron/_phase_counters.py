"""A phase's counters: one list per (gate, phase), counted in place by the calls of the phase,
and what each slot counts (``AttachHandle.stats()`` reads them by these names)."""

from __future__ import annotations

from typing import Final

RUN, SKIP, UNTOUCHED, DETACHED, MASKED = range(5)
COUNTED: Final = ("run", "skip", "untouched", "detached", "masked")


def new_counters() -> list[int]:
    """A phase's counters, all zero (:data:`COUNTED` names the slots)."""
    return [0] * len(COUNTED)

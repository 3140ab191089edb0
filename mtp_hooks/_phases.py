"""Phase names and the current-phase context: the ground floor every other module stands on.

The built-in phases are the members of :class:`Phase`. Custom phases are declared through the
catalogue (:mod:`mtp_hooks._phase_catalogue`), which also knows the phases plugins declare and
checks the names given to :func:`mtp_hooks.phase`. The current phase lives in a
:class:`contextvars.ContextVar`, so each thread and each asyncio task sees its own innermost
``phase()`` block.
"""

from __future__ import annotations

import contextvars
import enum

from ._errors import PolicyError


class Phase(str, enum.Enum):
    """The built-in phases. Members compare equal to their string values."""

    TRAIN = "train"
    """The update (a forward in ``train()`` mode with grad enabled)."""
    EVAL = "eval"
    """Log-probs, evaluation and a teacher (any other forward outside a ``phase()`` block)."""
    ROLLOUT = "rollout"
    """Named by the caller alone, inside ``with mtp_hooks.phase("rollout")``."""

    def __str__(self) -> str:
        return self.value


PhaseLike = Phase | str
"""A phase as hooks and API functions take it: a :class:`Phase` or a declared phase's name."""

BUILTIN: dict[str, Phase] = {p.value: p for p in Phase}
# The innermost phase() block of this thread or task; the gates read it at every forward.
explicit_phase: contextvars.ContextVar[Phase | str | None] = contextvars.ContextVar(
    "mtp_hooks_phase", default=None
)


def check_name(name: object, what: str) -> str:
    """Return ``name`` if it can name a phase (an identifier), else raise :class:`PolicyError`."""
    if not isinstance(name, str) or not name.isidentifier():
        raise PolicyError(
            f"{what} {name!r} is not a valid phase name; use an identifier such as 'distill'"
        )
    return name


def current_phase() -> Phase | str | None:
    """Return the innermost explicit phase of this thread or task, or ``None`` outside any block."""
    return explicit_phase.get()

"""Phases: the built-in ones, custom declarations and the current-phase context.

The current phase lives in a :class:`contextvars.ContextVar`, so each thread and each asyncio task
sees its own innermost :func:`phase` block.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
from collections.abc import Iterator

from . import _runtime
from ._errors import PolicyError


class Phase(str, enum.Enum):
    """The built-in phases. Members compare equal to their string values."""

    TRAIN = "train"
    EVAL = "eval"
    ROLLOUT = "rollout"

    def __str__(self) -> str:
        return self.value


PhaseLike = Phase | str
"""A phase as hooks and API functions take it: a :class:`Phase` or a declared phase's name."""

_BUILTIN: dict[str, Phase] = {p.value: p for p in Phase}
# The innermost phase() block of this thread or task; the gates read it at every forward.
explicit_phase: contextvars.ContextVar[Phase | str | None] = contextvars.ContextVar(
    "mtp_hooks_phase", default=None
)


def _check_name(name: object, what: str) -> str:
    if not isinstance(name, str) or not name.isidentifier():
        raise PolicyError(
            f"{what} {name!r} is not a valid phase name; use an identifier such as 'distill'"
        )
    return name


def declare_phase(name: str) -> str:
    """Declare a custom phase so that :func:`phase`, :func:`decide` and configs accept it.

    Plugins can declare phases too, through the ``declare_phases`` hook.

    Args:
        name: An identifier such as ``"distill"``. Declaring a built-in name is a no-op.

    Returns:
        The name.

    Example:
        >>> import mtp_hooks
        >>> mtp_hooks.declare_phase("distill")
        'distill'
    """
    _check_name(name, "declare_phase:")
    declared = _runtime.current.phases
    if name not in _BUILTIN and name not in declared:
        declared.add(name)
        _runtime.advance()
    return name


def known_phases() -> list[str]:
    """Every phase accepted right now: built-in, declared by API and declared by plugins."""
    from .plugins import _registry

    declared = _runtime.current.phases | _registry().plugin_phases()
    return list(_BUILTIN) + sorted(declared - set(_BUILTIN))


def normalize(name: object, where: str = "phase") -> Phase | str:
    """Return the canonical form of a phase, or raise :class:`PolicyError` listing known phases."""
    if isinstance(name, Phase):
        return name
    if isinstance(name, str):
        builtin = _BUILTIN.get(name)
        if builtin is not None:
            return builtin
        if name in _runtime.current.phases:
            return name
        from .plugins import _registry

        if name in _registry().plugin_phases():
            return name
    raise PolicyError(
        f"{where}: unknown phase {name!r}; known phases are {', '.join(known_phases())}. "
        "Declare a custom phase first with mtp_hooks.declare_phase(name) or a plugin's "
        "declare_phases hook."
    )


@contextlib.contextmanager
def phase(name: Phase | str) -> Iterator[Phase | str]:
    """Run everything inside the block in the given phase. Blocks nest; the innermost wins.

    Args:
        name: A :class:`Phase` or a declared phase name.

    Raises:
        PolicyError: If the phase is unknown. Nothing is changed then.

    Example:
        >>> import mtp_hooks
        >>> with mtp_hooks.phase("rollout"):
        ...     mtp_hooks.current_phase()
        <Phase.ROLLOUT: 'rollout'>
    """
    value = normalize(name, "mtp_hooks.phase()")
    token = explicit_phase.set(value)
    try:
        yield value
    finally:
        explicit_phase.reset(token)


def current_phase() -> Phase | str | None:
    """Return the innermost explicit phase of this thread or task, or ``None`` outside any block."""
    return explicit_phase.get()

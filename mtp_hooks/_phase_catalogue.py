"""The phases accepted right now: built-in, declared through the API, declared by plugins.

It sits above the plugin registry, since plugins declare phases through the ``declare_phases``
hook; :func:`phase` checks a name here before it enters the context of :mod:`._phases`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from . import _runtime
from ._errors import PolicyError
from ._phases import BUILTIN, Phase, check_name, explicit_phase
from ._plugin_registry import registry
from ._policy_errors import did_you_mean


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
    check_name(name, "declare_phase:")
    declared = _runtime.current.phases
    if name not in BUILTIN and name not in declared:
        declared.add(name)
        _runtime.advance()
    return name


def known_phases() -> list[str]:
    """Every phase accepted right now: built-in, declared by API and declared by plugins."""
    declared = _runtime.current.phases | registry().plugin_phases()
    return list(BUILTIN) + sorted(declared - set(BUILTIN))


def normalize(name: object, where: str = "phase") -> Phase | str:
    """Return the canonical form of a phase, or raise :class:`PolicyError` listing known phases."""
    if isinstance(name, Phase):
        return name
    if isinstance(name, str):
        builtin = BUILTIN.get(name)
        if builtin is not None:
            return builtin
        if name in _runtime.current.phases or name in registry().plugin_phases():
            return name
    known = known_phases()
    hint = did_you_mean(name, known) if isinstance(name, str) else ""
    raise PolicyError(
        f"{where}: unknown phase {name!r}{hint}; known phases are {', '.join(known)}. "
        "Declare a custom phase first with mtp_hooks.declare_phase(name) or a plugin's "
        "declare_phases hook.",
        phase=name if isinstance(name, str) else None,
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

"""The policy in force, as one immutable value with a version: :class:`PolicySnapshot`.

A decision reads a snapshot and the plugins' answers, nothing else of the process
(:func:`mtp_hooks._decision.combine`). The sources (:mod:`mtp_hooks._sources`) make a new
snapshot whenever what they read changes; so does anything else a decision depends on (a
plugin registered, a role set, a phase declared: :func:`mtp_hooks._runtime.advance`), with the
same entries and the next version. A cached decision or plan is valid for as long as the
version it was made at is the runtime's.

This module stands on the ground floor: it imports nothing of the package at run time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._errors import PolicyError
    from ._policy_entry import Key, PolicyEntry

_NONE: Mapping[Any, Any] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class PolicySnapshot:
    """The merged policy config at one moment.

    Attributes:
        version: Advances with every change a decision depends on; never goes back, also
            across :func:`mtp_hooks.testing.reset`. Default ``0``.
        entries: Each (role, phase) entry of the merged sources, read-only; a higher source's
            entry has replaced a lower one's. Default empty.
        trace: Whether decisions are logged (``MTP_HOOKS_TRACE`` as last read). Default
            ``False``.
        error: Why the policy file cannot be read since its last change, raised by every
            lookup until the file is fixed or :func:`mtp_hooks.reload` replaces it; else
            ``None`` (the default).
    """

    version: int = 0
    entries: Mapping[Key, PolicyEntry] = field(default_factory=lambda: _NONE)
    trace: bool = False
    error: PolicyError | None = None

    def lookup(self, role: str | None, phase: str) -> PolicyEntry | None:
        """The entry for ``role`` in ``phase``: the role's own first, then the phase's.

        Raises:
            PolicyError: The policy file is broken (:attr:`error`).
        """
        if self.error is not None:
            raise self.error
        entries = self.entries
        if role is not None:
            entry = entries.get((role, phase))
            if entry is not None:
                return entry
        return entries.get((None, phase))

    def roles(self) -> list[str]:
        """The roles its entries name, sorted.

        Raises:
            PolicyError: The policy file is broken (:attr:`error`).
        """
        if self.error is not None:
            raise self.error
        return sorted({role for role, _ in self.entries if role is not None})

    def advanced(self, **changes: Any) -> PolicySnapshot:
        """The next version, with ``changes`` (``entries``, ``trace``, ``error``) made."""
        if "entries" in changes:
            changes["entries"] = MappingProxyType(dict(changes["entries"]))
        return replace(self, version=self.version + 1, **changes)

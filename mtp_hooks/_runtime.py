"""The process state of mtp-hooks, on one object that :func:`mtp_hooks.reset` replaces.

Everything a decision depends on lives on :data:`current`: the plugin registry, the policy
sources, the phases declared through the API, the models' roles, the memo of config decisions,
and the generation counter. Whatever changes one of them calls :func:`advance`, so a gate may
reuse a decision for as long as ``current.generation`` stands still. Gates read the object
through this one module attribute at every forward.

Nothing is created at import time but an empty :class:`Runtime`; the registry (with its entry
points) and the policy state are built on first use.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._plugin_registry import PluginRegistry
    from ._sources import PolicyState


class Runtime:
    """The state of mtp-hooks in this process (see the module docstring)."""

    __slots__ = (
        "generation",
        "watching",
        "policy",
        "registry",
        "phases",
        "roles",
        "memo",
        "memo_generation",
        "listeners",
    )

    def __init__(self, generation: int = 0, listeners: weakref.WeakSet[Any] | None = None) -> None:
        self.generation = generation
        """Advances whenever anything a decision depends on changes."""
        self.watching = True
        """Whether :func:`mtp_hooks._sources.generation` has work: the environment is unread,
        or a policy file is watched. Gates call it only then."""
        self.policy: PolicyState | None = None
        """The policy sources in force (made at first use, swapped whole by ``reload()``)."""
        self.registry: PluginRegistry | None = None
        """The plugin registry, built with its entry points at first use."""
        self.phases: set[str] = set()
        """Custom phases declared through :func:`mtp_hooks.declare_phase`."""
        self.roles: weakref.WeakKeyDictionary[object, str] = weakref.WeakKeyDictionary()
        """Each model's role, held weakly."""
        self.memo: dict[tuple[str | None, Any], Any] = {}
        """Decisions that consulted no plugin, by (role, phase), for ``memo_generation``."""
        self.memo_generation = -1
        self.listeners: weakref.WeakSet[Any] = weakref.WeakSet() if listeners is None else listeners
        """Objects whose ``after_advance()`` runs after every :func:`advance`, held weakly:
        gates of models whose captured CUDA graphs must follow a change, since no hook of
        theirs runs while megatron replays them."""


current = Runtime()


def advance() -> None:
    """Invalidate every cached decision, and tell the listeners."""
    current.generation += 1
    _tell_listeners()


def replace() -> None:
    """Start over with a fresh :class:`Runtime` (:func:`mtp_hooks.reset`). The counter keeps
    counting, so no decision a gate cached before can pass for a new one; the listeners, which
    belong to attached models rather than to the policy, stay, and are told."""
    global current
    current = Runtime(current.generation + 1, current.listeners)
    _tell_listeners()


def _tell_listeners() -> None:
    if current.listeners:
        for listener in list(current.listeners):
            listener.after_advance()

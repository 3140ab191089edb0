"""The process state of mtp-hooks, on two objects with two lifetimes.

* **The policy**, :data:`current` (a :class:`Runtime`, replaced whole by
  :func:`mtp_hooks.testing.reset`): the snapshot of the policy in force
  (:class:`~mtp_hooks._policy_snapshot.PolicySnapshot`, immutable, with a version), the
  sources it is read from, the policy options in force (with those installed distributions
  contribute), the plugin registry, the phases declared through the API, the models' roles,
  and the memo of decisions made from the snapshot. Whatever changes what a
  decision reads calls :func:`advance`, which puts the snapshot's next version in force, so a
  gate may reuse a decision for as long as the version stands still.
* **The models and the process**, :data:`process` (a :class:`ProcessState`, never replaced,
  since it belongs to models that stay attached across a reset, or to the interpreter): the
  table of attached models, auto-attach's registries, the gates that follow every change, each
  thread's frame reader, the warnings already given, and the callbacks that run at a reset.

Nothing is created at import time but the two empty objects; the registry (with its entry
points), the contributed options and the policy's sources are built on first use.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from ._policy_snapshot import PolicySnapshot


class AutoAttachState:
    """What auto-attach (:mod:`mtp_hooks.megatron._auto`) keeps, every table held weakly."""

    __slots__ = (
        "registration",
        "clip_mtp_apart",
        "watchers",
        "parents",
        "wrappers",
        "handles",
        "lock",
    )

    def __init__(self) -> None:
        self.registration: Any = None
        """torch's handle of the module registration hook while auto-attach is on, else None."""
        self.clip_mtp_apart = False
        """Whether models get their MTP weights clipped apart as they are built."""
        self.watchers: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        """Model -> the handle of its one-shot first-forward hook."""
        self.parents: weakref.WeakKeyDictionary[Any, weakref.ref[Any]] = weakref.WeakKeyDictionary()
        """Module -> the wrapper built around it (``wrapper.module = module``)."""
        self.wrappers: weakref.WeakSet[Any] = weakref.WeakSet()
        """The wrappers around a watched model."""
        self.handles: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        """Model -> the AttachHandle auto-attach made for it at its first forward."""
        self.lock = threading.RLock()
        """Held while a model is attached (by a first forward or by ``attach``) or a handle's
        bookkeeping is removed: another thread's attach waits, then finds the handle."""


class Runtime:
    """The policy's state in this process (see the module docstring), which
    :func:`mtp_hooks.testing.reset` replaces whole."""

    __slots__ = (
        "snapshot",
        "watching",
        "sources",
        "registry",
        "phases",
        "roles",
        "memo",
        "votes_memo",
        "memo_version",
        "options",
    )

    def __init__(self, version: int = 0) -> None:
        self.snapshot = PolicySnapshot(version)
        """The policy in force; a new version whenever anything a decision reads changes."""
        self.watching = True
        """Whether :func:`mtp_hooks._sources.refresh` has work: the environment is unread, or a
        policy file is watched. Gates call it only then."""
        # The two below are typed where they are made and read (_sources._sources() and
        # _plugin_registry.registry()): this ground-floor module names no higher one.
        self.sources: Any = None
        """What the snapshot is read from (made at first use, swapped whole by
        ``reload()``)."""
        self.registry: Any = None
        """The plugin registry, built with its entry points at first use."""
        self.phases: set[str] = set()
        """Custom phases declared through :func:`mtp_hooks.declare_phase`."""
        self.roles: weakref.WeakKeyDictionary[object, str] = weakref.WeakKeyDictionary()
        """Each model's role, held weakly."""
        self.memo: dict[tuple[str | None, Any], Any] = {}
        """Decisions that consulted no plugin, by (role, phase), made from the snapshot of
        version ``memo_version``."""
        self.votes_memo: weakref.WeakKeyDictionary[object, dict[Any, Mapping[str, bool | None]]] = (
            weakref.WeakKeyDictionary()
        )
        """The plugins' cacheable votes by name, per model (held weakly) and (role, phase),
        given at ``memo_version``."""
        self.memo_version = -1
        self.options: Any = None
        """Every policy option in force, the contributed ones loaded at first use (typed
        where it is made, :func:`mtp_hooks._options.options`)."""


class ProcessState:
    """What belongs to attached models and to the interpreter (see the module docstring):
    made once, never replaced, so a module may keep a reference to one of its fields."""

    __slots__ = ("listeners", "attached", "auto", "threads", "warned", "reset_callbacks")

    def __init__(self) -> None:
        self.listeners: weakref.WeakSet[Any] = weakref.WeakSet()
        """Objects whose ``after_advance()`` runs after every :func:`advance`, held weakly:
        gates of models whose captured CUDA graphs must follow a change, since no hook of
        theirs runs while megatron replays them."""
        self.attached: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        """Model -> the AttachHandle that gates it."""
        self.auto = AutoAttachState()
        self.threads = threading.local()
        """Each thread's frame reader (``resumer``), made at its first gated call."""
        self.warned: set[str] = set()
        """The once-per-process warnings already given."""
        self.reset_callbacks: list[Callable[[], Callable[[], None] | None]] = []
        """What :func:`mtp_hooks.testing.reset` calls first: each entry returns the callback, or
        ``None`` once the object it belongs to is gone (see :func:`on_reset`)."""


current = Runtime()
"""The policy's state, replaced by :func:`replace`: read it through this attribute each time."""
process = ProcessState()
"""The models' and the process's state, never replaced."""


def advance(**changes: Any) -> None:
    """Put the snapshot's next version in force, with ``changes`` to its fields (the sources
    pass ``entries``, ``trace`` and ``error``; anything else that a decision reads passes
    none): every cached decision and plan is stale. Then tell the listeners."""
    current.snapshot = current.snapshot.advanced(**changes)
    _tell_listeners()


def replace() -> None:
    """Start over with a fresh policy (:func:`mtp_hooks.testing.reset`). The version keeps
    counting, so no decision a gate cached before can pass for a new one; :data:`process`
    stays as it is, and the listeners are told."""
    global current
    current = Runtime(current.snapshot.version + 1)
    _tell_listeners()


def on_reset(callback: Callable[[], None]) -> None:
    """Have :func:`mtp_hooks.testing.reset` call ``callback`` (a bound method is held weakly)."""
    if hasattr(callback, "__self__") and hasattr(callback, "__func__"):
        method = weakref.WeakMethod(callback)
        process.reset_callbacks.append(method)
    else:
        process.reset_callbacks.append(lambda: callback)


def run_reset_callbacks() -> None:
    """Call every live reset callback, in registration order, and forget the dead ones."""
    live = []
    for entry in process.reset_callbacks:
        callback = entry()
        if callback is not None:
            live.append(entry)
            callback()
    process.reset_callbacks[:] = live


def warn_once(message: str, stacklevel: int = 3) -> None:
    """Emit ``message`` as a ``RuntimeWarning`` once per process."""
    if message not in process.warned:
        import warnings

        process.warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)


def _tell_listeners() -> None:
    if process.listeners:
        for listener in list(process.listeners):
            listener.after_advance()

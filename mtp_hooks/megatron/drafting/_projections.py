"""megatron's own output-layer projections in one forward, told apart: each MTP depth's, then
the policy's.

A forward that computes an MTP loss projects through ``model.output_layer`` once per depth,
inside ``process_mtp_loss``, and then once for the policy's own logits. ``+objective`` reads
each depth's and the policy's (:mod:`._objectives`), ``+metrics``' sampled figures the policy's
(:mod:`._recorder`). They read them from one forward hook per model, registered while a call
listens and removed when none does, so that which projection is which is decided in one place.
The projections mtp-hooks makes itself go through ``output_layer.forward``, never the module
call, so they never reach this hook.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

if TYPE_CHECKING:
    from .._call_extensions import Extensions

__all__ = ["Listener", "Projections", "shared"]


class Listener(Protocol):
    """What hears one thread's projections (``Recorder``, ``Objectives``)."""

    def depth(self, model: Any, depth: int, logits: torch.Tensor) -> None:
        """MTP depth ``depth``'s projection (0 first), before megatron's cross-entropy, which
        overwrites ``logits`` in place right after."""

    def policy(self, model: Any, logits: torch.Tensor) -> None:
        """The policy's projection, after every depth's."""


class _Listening:
    """One thread's forward: the projections seen since its first listener, and its
    listeners."""

    __slots__ = ("listeners", "seen")

    def __init__(self) -> None:
        self.seen = 0
        self.listeners: list[Listener] = []


class Projections:
    """The projections of one gated model's forwards, by thread, and the hook that sees them."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = weakref.ref(model)
        self.lock = threading.Lock()
        self.threads: dict[int, _Listening] = {}
        self.handle: torch.utils.hooks.RemovableHandle | None = None

    def listen(self, model: Any, listener: Listener) -> None:
        """Pass ``listener`` the projections of this thread's forward of ``model`` from now:
        counted from the first listener's start, so listeners that start in one call count
        alike."""
        with self.lock:
            listening = self.threads.get(threading.get_ident())
            if listening is None:
                listening = self.threads[threading.get_ident()] = _Listening()
            if listener not in listening.listeners:
                listening.listeners.append(listener)
            if self.handle is None:
                self.handle = model.output_layer.register_forward_hook(self._on_output)

    def stop(self, listener: Listener) -> None:
        """Stop passing ``listener`` this thread's projections (its call ended, or was
        interrupted); the hook goes once no thread listens."""
        with self.lock:
            thread = threading.get_ident()
            listening = self.threads.get(thread)
            if listening is not None and listener in listening.listeners:
                listening.listeners.remove(listener)
                if not listening.listeners:
                    del self.threads[thread]
            self._drop_hook_if_idle()

    def forget(self, listener: Listener) -> None:
        """Stop passing ``listener`` any thread's projections (its model's gate is removed and
        no call of the model is running: what calls interrupted left behind)."""
        with self.lock:
            for thread, listening in list(self.threads.items()):
                if listener in listening.listeners:
                    listening.listeners.remove(listener)
                if not listening.listeners:
                    del self.threads[thread]
            self._drop_hook_if_idle()

    def _drop_hook_if_idle(self) -> None:
        """Remove the hook once no thread listens (called under the lock)."""
        if not self.threads and self.handle is not None:
            self.handle.remove()
            self.handle = None

    def _on_output(self, layer: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        with self.lock:
            listening = self.threads.get(threading.get_ident())
            if listening is None:
                return
            index = listening.seen
            listening.seen += 1
            listeners = tuple(listening.listeners)
        model: Any = self._model()
        if model is None:
            return
        depths = model.config.mtp_num_layers
        if index < depths:
            for listener in listeners:
                listener.depth(model, index, output[0])
        elif index == depths:
            for listener in listeners:
                listener.policy(model, output[0])

    def __deepcopy__(self, memo: dict[int, Any]) -> Projections:
        """A copied model hears nothing of the original's calls (its gate starts without
        one)."""
        new = object.__new__(Projections)
        new._model, new.lock, new.threads, new.handle = self._model, threading.Lock(), {}, None
        return new


def shared(model: torch.nn.Module, extensions: Extensions) -> Projections:
    """The watcher of ``model``'s projections that its gate's extensions share (``+metrics``
    and ``+objective`` read the same projections), made by the first that needs it.
    ``extensions``: the gate's :class:`~mtp_hooks.megatron._call_extensions.Extensions`, whose
    lock is held while a kind is made."""
    projections = extensions.shared.get("projections")
    if projections is None:
        projections = extensions.shared["projections"] = Projections(model)
    return cast(Projections, projections)

"""Per-call extensions: what a forward call of a gated model does beside gating MTP.

The gate's core applies a plan's run or skip and restores it. Everything else a call asks for
is an extension, begun by the gate's pre-hook once the call is planned (and before the gates
change) and ended by its forward hook once the gates are back (also when forward raised):

* ``+mask:labels``, plugins' ``mtp_loss_mask`` answers and :func:`mtp_hooks.mtp_loss_mask`
  blocks set the call's ``loss_mask`` (:mod:`._loss_masking`);
* ``+metrics`` measures the call's MTP (:mod:`.drafting._recorder`);
* ``+objective`` adds the call's objective to its output (:mod:`.drafting._objectives`).

A plan lists the kinds its calls begin (:attr:`._phase_plan.PhasePlan.extensions`), in the
order they run: a mask comes before the metrics that read it. A gate makes one extension of
each kind at its first call (:class:`Extensions`), so a model that never asks for one pays
nothing for it, and a deep copy of the model starts without any.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    import torch

    from .._options import Options


class PlannedCall(Protocol):
    """What an extension reads of a call's plan (:class:`._phase_plan.PhasePlan` has these; a
    protocol, so that the plan, which lists the kinds, and the kinds import nothing of each
    other)."""

    @property
    def phase(self) -> Any:
        """The call's phase."""

    @property
    def counters(self) -> list[int]:
        """The phase's counters (:mod:`._phase_counters`), counted in place."""

    @property
    def options(self) -> Options:
        """What the policy options decided for the call (``options.loss_scale``, ...)."""


class CallExtension(Protocol):
    """One kind of per-call work, for one gated model; its calls may run on several threads."""

    ends: ClassVar[bool]
    """Whether :meth:`end` does anything: a kind that only prepares the call (a mask, set in the
    call's own keyword arguments) leaves nothing open, so it is never asked to end, cancel or
    drop anything, and the forward hook does not look at it at every later call."""

    def begin(
        self,
        module: torch.nn.Module,
        plan: PlannedCall,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        config: Any,
    ) -> None:
        """Start this call's work. ``kwargs`` is the dict torch builds for this call alone;
        ``config`` is the model's own config (the gates may show the model another one).

        Raises:
            MTPHooksError: What the call asks cannot be done; the gates are not changed yet.
        """

    def end(self, module: torch.nn.Module, output: Any) -> Any:
        """End this thread's call: ``output`` is the forward's output, ``None`` where it raised.
        Return the output to hand on in its place, or ``None`` to keep it."""

    def cancel(self) -> None:
        """Drop what this thread's interrupted call (``KeyboardInterrupt``) left open."""

    def drop_all(self) -> None:
        """Drop what every call left open: the gate is removed and no call of it runs."""


Kind = Callable[[Any, "Extensions"], CallExtension]
"""Makes a kind's extension for a gated model: ``kind(model, extensions)``; what kinds share
(megatron's output-layer projections, watched once) lives in ``extensions.shared``."""


class Extensions:
    """The extensions one gate has made, by kind, in the order they were first begun."""

    __slots__ = ("by_kind", "ending", "lock", "shared")

    def __init__(self, lock: threading.Lock) -> None:
        self.by_kind: dict[Kind, CallExtension] = {}
        self.ending: list[CallExtension] = []
        """Those whose :meth:`~CallExtension.end` does something: the forward hook's one check."""
        self.lock = lock
        """The gate's lock: a phase's counters are shared by its calls."""
        self.shared: dict[str, Any] = {}

    def begin(
        self,
        kinds: tuple[Kind, ...],
        module: torch.nn.Module,
        plan: PlannedCall,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        config: Any,
    ) -> None:
        """Begin each of ``kinds`` for this call, in order."""
        for kind in kinds:
            extension = self.by_kind.get(kind)
            if extension is None:
                extension = self.made(kind, module)
            extension.begin(module, plan, args, kwargs, config)

    def made(self, kind: Kind, module: Any) -> CallExtension:
        """The extension of ``kind``, made now if it is not yet."""
        with self.lock:  # two threads' first calls must share one
            extension = self.by_kind.get(kind)
            if extension is None:
                extension = self.by_kind[kind] = kind(module, self)
                if extension.ends:
                    # in place: the gate's forward hook holds this list (one load per call);
                    # an end that sees a kind made during its loop finds no call of its thread
                    self.ending.append(extension)
        return extension

    def end(self, module: torch.nn.Module, output: Any) -> Any:
        """End this call's extensions; the output to hand on in place of ``output``, or
        ``None`` to keep it."""
        replaced = None
        for extension in self.ending:
            given = extension.end(module, output if replaced is None else replaced)
            if given is not None:
                replaced = given
        return replaced

    def cancel(self) -> None:
        """Drop what this thread's interrupted calls left open."""
        for extension in self.ending:
            extension.cancel()

    def drop_all(self) -> None:
        """Drop what every call left open (the gate is removed)."""
        for extension in self.ending:
            extension.drop_all()

    def get(self, kind: Kind) -> CallExtension | None:
        """The extension of ``kind``, if a call has made it."""
        return self.by_kind.get(kind)

"""MTP quality metrics outside training, recorded through a one-shot forward hook on ``model.mtp``.

A forward whose decision asks for metrics (``eval=run+metrics``) leaves a request for its
thread; the hook on ``model.mtp`` takes it when the MTP block returns its hidden states (the
main chunk followed by one chunk per depth), and computes, for each depth, what Megatron's
``process_mtp_loss`` computes for its training-mode log: the output layer's logits, the
vocab-parallel cross-entropy of the model's own ``compute_language_model_loss`` over the rolled
labels and loss mask, and the top-1 hits (:mod:`._depth_figures`). That is one extra
output-layer projection per depth. Totals stay on the device (no host sync) until
:meth:`Recorder.metrics` reads them. Forwards that record nothing pay nothing: no hook is
registered then.
"""

from __future__ import annotations

import copy
import threading
import weakref
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ... import plugins
from ..._metrics import MTPMetrics
from ._depth_figures import (
    Drafts,
    add_by_depth,
    depth_values,
    sampled_values,
    to_metrics,
)
from ._loss_request import Request, loss_request
from ._projections import shared

if TYPE_CHECKING:
    from .._call_extensions import Extensions, PlannedCall

__all__ = ["Recorder", "running_means"]


class Recorder:
    """The metrics of one gated model: pending requests by thread, and totals by phase. The
    per-call extension of ``+metrics`` (:mod:`mtp_hooks.megatron._call_extensions`): a call
    begins a request, and its end adds what it recorded."""

    ends: ClassVar[bool] = True

    def __init__(self, model: torch.nn.Module, extensions: Extensions) -> None:
        self._model = weakref.ref(model)
        # the policy's projection, which the sampled figures read
        self.projections = shared(model, extensions)
        self.lock = threading.Lock()
        self.pending: dict[int, Request] = {}
        # thread -> (phase, forward values, the same in float64): what a running forward
        # recorded, added to the totals only when the forward completes
        self.done: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}
        self.totals: dict[Any, tuple[torch.Tensor, int]] = {}  # phase -> (float64 sums, forwards)
        self.handle: torch.utils.hooks.RemovableHandle | None = None
        # thread -> (request, drafts) between the MTP block's output and the policy's projection
        self.waiting: dict[int, tuple[Request, Drafts]] = {}

    def begin(
        self,
        model: Any,
        plan: PlannedCall,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        config: Any,
    ) -> None:
        """Ask for this thread's forward of ``model`` (starting now) to be recorded."""
        request = loss_request(model, plan.phase, args, kwargs)
        if request is None:
            return
        with self.lock:
            self.pending[threading.get_ident()] = request
            if self.handle is None:
                self.handle = model.mtp.register_forward_hook(self._on_mtp)
        self.projections.listen(model, self)

    def cancel(self) -> None:
        """Drop this thread's request and what its forward recorded so far (left by a call
        interrupted before it ended: an interrupted forward counts for nothing)."""
        with self.lock:
            thread = threading.get_ident()
            self.pending.pop(thread, None)
            self.waiting.pop(thread, None)
            self.done.pop(thread, None)
            self._drop_hook_if_idle()
        self.projections.stop(self)

    def _on_mtp(self, block: torch.nn.Module, args: tuple[Any, ...], hidden: torch.Tensor) -> None:
        thread = threading.get_ident()
        with self.lock:
            request = self.pending.pop(thread, None)
            self._drop_hook_if_idle()
        if request is None:
            return
        model: Any = self._model()
        if model is None:
            return
        values, drafts = depth_values(model, request, hidden)
        with self.lock:
            self.done[thread] = (request.phase, values, values.double())
            self.waiting[thread] = (request, drafts)  # until the policy's projection

    def depth(self, model: Any, depth: int, logits: torch.Tensor) -> None:
        """A depth's projection for megatron's own loss: the figures took theirs already."""

    def policy(self, model: Any, logits: torch.Tensor) -> None:
        """The policy's projection: the sampled figures of this thread's recorded forward."""
        thread = threading.get_ident()
        with self.lock:
            entry = self.waiting.pop(thread, None)
        if entry is None:
            return
        request, drafts = entry
        extra = sampled_values(model, request, drafts, logits)
        with self.lock:
            done = self.done.get(thread)
            if done is not None:
                self.done[thread] = (done[0], done[1] + extra, done[2] + extra.double())

    def end(self, model: torch.nn.Module, output: Any) -> None:
        """End this thread's forward: drop its unanswered request; add what a completed forward
        recorded to the totals and hand it to the plugins' ``mtp_metrics`` (converting only if
        one listens). A forward that raised (``output`` ``None``) counts for nothing."""
        with self.lock:
            done = self.done.pop(threading.get_ident(), None)
        self.cancel()
        if done is None or output is None:
            return None
        phase, values, exact = done
        with self.lock:
            sums, forwards = self.totals.get(phase, (None, 0))
            self.totals[phase] = (exact if sums is None else sums + exact, forwards + 1)
        if plugins.implements("mtp_metrics"):
            plugins.answers("mtp_metrics", model=model, phase=phase, metrics=to_metrics(values, 1))
        return None

    def drop_all(self) -> None:
        """Drop every request and what it recorded, and the hook (no call of the model runs:
        what interrupted calls left)."""
        with self.lock:
            self.pending.clear()
            self.waiting.clear()
            self.done.clear()
            self._drop_hook_if_idle()
        self.projections.forget(self)

    def _drop_hook_if_idle(self) -> None:
        if not self.pending and self.handle is not None:
            self.handle.remove()
            self.handle = None

    def take(self, reset: bool) -> dict[Any, tuple[torch.Tensor, int]]:
        """The totals by phase, ``(float64 [ROWS, depths] sums, forwards)`` (see
        :mod:`._depth_figures`); ``reset`` clears them."""
        with self.lock:
            totals = dict(self.totals)
            if reset:
                self.totals.clear()
        return totals

    def __deepcopy__(self, memo: dict[int, Any]) -> Recorder:
        """A copied model records nothing of the original's (its gate starts without one)."""
        new = object.__new__(Recorder)
        new.__dict__.update(self.__dict__)
        new.lock, new.pending, new.done, new.totals, new.handle = threading.Lock(), {}, {}, {}, None
        new.waiting, new.projections = {}, copy.deepcopy(self.projections, memo)
        return new


def running_means(recorders: list[Recorder], reset: bool) -> dict[str, MTPMetrics]:
    """The running means by phase over ``recorders`` (their sums added: token-weighted). Models
    of different MTP depth add up depth by depth; a depth only some have counts only theirs."""
    combined: dict[str, tuple[torch.Tensor, int]] = {}
    for recorder in recorders:
        for phase, (sums, forwards) in recorder.take(reset).items():
            seen = combined.get(str(phase))
            if seen is not None:
                sums, forwards = add_by_depth(seen[0], sums), seen[1] + forwards
            combined[str(phase)] = (sums, forwards)
    return {phase: to_metrics(sums, n) for phase, (sums, n) in sorted(combined.items())}

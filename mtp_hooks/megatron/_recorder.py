"""MTP quality metrics outside training, recorded through a one-shot forward hook on ``model.mtp``.

A forward whose decision asks for metrics (``eval=run+metrics``) leaves a request for its
thread; the hook on ``model.mtp`` takes it when the MTP block returns its hidden states (the
main chunk followed by one chunk per depth), and computes, for each depth, what Megatron's
``process_mtp_loss`` computes for its training-mode log: the output layer's logits, the
vocab-parallel cross-entropy of the model's own ``compute_language_model_loss`` over the rolled
labels and loss mask, and the top-1 hits. That is one extra output-layer projection per depth.
Totals stay on the device (no host sync) until :meth:`Recorder.metrics` reads them. Forwards
that record nothing pay nothing: no hook is registered then.
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from megatron.core.transformer import multi_token_prediction as _mtp

from .._metrics import MTPMetrics
from .._plugin_registry import registry as _registry

# Rows of a [6, depths] values tensor: per depth the masked loss sum, the top-1 hits, the
# positions that count (mask != 0), then the chained hits (every depth up to this one hit) and the
# chained positions (every depth up to this one has the position), and the mask's sum: a
# weighted mask weighs the loss (megatron's weighted mean), never the acceptance.
_LOSS, _CORRECT, _TOKENS, _CHAIN, _CHAIN_POSITIONS, _MASK_SUM = range(6)


@functools.lru_cache(maxsize=1)
def derives_labels() -> bool:
    """Whether this Megatron computes the MTP loss from ``input_ids`` when labels are None."""
    process = getattr(_mtp, "process_mtp_loss", None)
    return process is not None and "input_ids" in inspect.signature(process).parameters


@functools.cache
def _forward_signature(cls: Any) -> inspect.Signature:
    """The signature of the nearest ``forward`` in ``cls``'s MRO that names ``labels``: a
    subclass's ``forward(*args, flag=..., **kwargs)`` passes its arguments to megatron's."""
    for klass in cls.__mro__:
        forward = klass.__dict__.get("forward")
        if forward is not None and "labels" in inspect.signature(forward).parameters:
            return inspect.signature(forward)
    return inspect.signature(cls.forward)


def call_arguments(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The named arguments of one call of ``model``'s forward (those the signature names)."""
    signature = _forward_signature(cast(Any, type(model)))  # a class: hashable
    named = {k: v for k, v in kwargs.items() if k in signature.parameters}
    return signature.bind_partial(model, *args, **named).arguments


def takes_loss_mask(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forward names a ``loss_mask``."""
    return "loss_mask" in _forward_signature(cast(Any, type(model))).parameters


@dataclass
class _Request:
    phase: Any
    labels: torch.Tensor | None
    loss_mask: torch.Tensor | None
    input_ids: torch.Tensor | None
    packed_seq_params: Any
    runtime_gather_output: bool | None


class Recorder:
    """The metrics of one gated model: pending requests by thread, and totals by phase."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = weakref.ref(model)
        self.derive = derives_labels()
        self.lock = threading.Lock()
        self.pending: dict[int, _Request] = {}
        self.done: dict[int, tuple[Any, torch.Tensor]] = {}  # thread -> (phase, forward values)
        self.totals: dict[Any, tuple[torch.Tensor, int]] = {}  # phase -> (float64 sums, forwards)
        self.handle: torch.utils.hooks.RemovableHandle | None = None

    def request(
        self, model: Any, phase: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """Ask for this thread's forward of ``model`` (starting now) to be recorded."""
        if not getattr(model, "post_process", True) or getattr(model, "mtp", None) is None:
            return  # no labels or output layer on this pipeline stage
        bound = call_arguments(model, args, kwargs)
        labels, input_ids = bound.get("labels"), bound.get("input_ids")
        if labels is None and not (self.derive and input_ids is not None):
            return  # Megatron computes no MTP loss for this forward
        request = _Request(
            phase,
            labels,
            bound.get("loss_mask"),
            input_ids,
            bound.get("packed_seq_params"),
            bound.get("runtime_gather_output"),
        )
        with self.lock:
            self.pending[threading.get_ident()] = request
            if self.handle is None:
                self.handle = model.mtp.register_forward_hook(self._on_mtp)

    def cancel(self) -> None:
        """Drop this thread's request (left by a call interrupted before it ended)."""
        with self.lock:
            self.pending.pop(threading.get_ident(), None)
            self._drop_hook_if_idle()

    def _on_mtp(self, block: torch.nn.Module, args: tuple[Any, ...], hidden: torch.Tensor) -> None:
        thread = threading.get_ident()
        with self.lock:
            request = self.pending.pop(thread, None)
            self._drop_hook_if_idle()
        if request is None:
            return
        model = self._model()
        if model is None:
            return
        values = depth_values(model, request, hidden)
        with self.lock:
            sums, forwards = self.totals.get(request.phase, (None, 0))
            sums = values.double() if sums is None else sums + values.double()
            self.totals[request.phase] = (sums, forwards + 1)
            self.done[thread] = (request.phase, values)

    def end(self, model: torch.nn.Module, completed: bool) -> None:
        """End this thread's forward: drop its unanswered request, and hand what a completed
        forward recorded to the plugins' ``mtp_metrics`` (converting only if one listens)."""
        self.cancel()
        with self.lock:
            done = self.done.pop(threading.get_ident(), None)
        registry = _registry()
        if done is not None and completed and registry.implements("mtp_metrics"):
            registry.report_metrics(model, done[0], to_metrics(done[1], 1))

    def _drop_hook_if_idle(self) -> None:
        if not self.pending and self.handle is not None:
            self.handle.remove()
            self.handle = None

    def take(self, reset: bool) -> dict[Any, tuple[torch.Tensor, int]]:
        """The totals by phase, ``(float64 [6, depths] sums, forwards)``; ``reset`` clears them."""
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
        return new


def to_metrics(values: torch.Tensor, forwards: int) -> MTPMetrics:
    """Means of ``[6, depths]`` sums (see ``_LOSS``) over ``forwards`` (a host sync).

    Divided in ``values``' dtype, so one forward's float32 loss is bit for bit the value
    Megatron logs for it (``sum / num_tokens.clamp(min=1)``, ``num_tokens`` the mask's sum).
    Acceptance is hits over the positions whose mask is not 0, whatever their weight.
    """
    loss = (values[_LOSS] / values[_MASK_SUM].clamp(min=1)).tolist()
    acceptance = (values[_CORRECT] / values[_TOKENS].clamp(min=1)).tolist()
    tokens = [int(n) for n in values[_TOKENS].tolist()]
    chain = (values[_CHAIN] / values[_CHAIN_POSITIONS].clamp(min=1)).tolist()
    accepted = float(values[_CHAIN].sum() / values[_CHAIN_POSITIONS][0].clamp(min=1))
    return MTPMetrics(
        loss=tuple(loss),
        acceptance=tuple(acceptance),
        tokens=tuple(tokens),
        forwards=forwards,
        chain_acceptance=tuple(chain),
        accepted_length=accepted,
    )


def depth_values(model: Any, request: _Request, hidden: torch.Tensor) -> torch.Tensor:
    """``[6, depths]`` float32: the masked loss sum, top-1 hits and positions of each depth,
    computed the way ``process_mtp_loss`` computes them (same calls, same order), and the
    chained hits and positions. Depth ``d`` at position ``i`` drafts token ``i + d + 1``, so a
    greedy chain from position ``i`` accepts depths ``1..k`` when each of them hits at ``i``."""
    depths = model.config.mtp_num_layers
    cp_group, psp = model.cp_group, request.packed_seq_params

    def roll(tensor: Any) -> Any:
        return _mtp.roll_tensor(
            tensor, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=psp
        )

    with torch.no_grad():
        chunks = torch.chunk(hidden, 1 + depths, dim=0)
        labels, mask = request.labels, request.loss_mask
        if labels is None:  # Megatron derives them: label[i] = input_ids[i + 1]
            labels, _ = roll(request.input_ids)
            mask, _ = roll(torch.ones_like(labels) if mask is None else mask)
        elif mask is None:
            mask = torch.ones_like(labels)
        weight = model.shared_embedding_or_output_weight() if _tied(model) else None
        scale: Callable[[torch.Tensor], torch.Tensor] | None = (
            model._scale_logits if getattr(model.config, "use_mup", False) else None
        )
        rows = []
        chain: torch.Tensor | None = None  # [s, b]: every depth so far hit here
        present: torch.Tensor | None = None  # [s, b]: every depth so far has this position
        for depth in range(depths):
            logits, _ = model.output_layer(
                chunks[depth + 1],
                weight=weight,
                runtime_gather_output=request.runtime_gather_output,
            )
            if scale is not None:
                logits = scale(logits)
            labels, _ = roll(labels)
            mask, mask_sum = roll(mask)
            loss = torch.sum(mask * model.compute_language_model_loss(labels, logits))
            valid = mask.t() != 0
            hits = (_top1(model, logits, request.runtime_gather_output) == labels.t()) & valid
            chain = hits if chain is None else chain & hits
            present = valid if present is None else present & valid
            rows.append(
                torch.stack(
                    [
                        loss.float(),
                        hits.sum().float(),
                        valid.sum().float(),
                        chain.sum().float(),
                        present.sum().float(),
                        mask_sum.float(),
                    ]
                )
            )
        return torch.stack(rows, dim=1)


def _tied(model: Any) -> bool:
    return bool(getattr(model, "share_embeddings_and_output_weights", False))


def _top1(model: Any, logits: torch.Tensor, gather: bool | None) -> torch.Tensor:
    """``[s, b]`` global top-1 token ids; exact when the vocab is split across TP ranks.

    Each rank contributes its shard's maximum and its index; the first rank holding the global
    maximum wins, which is the tie rule of ``argmax`` over the whole vocabulary (and of
    Megatron's own acceptance count).
    """
    sharded = (
        (not gather)
        if gather is not None
        else not getattr(model.output_layer, "gather_output", False)
    )
    group = getattr(model, "tp_group", None)
    size = torch.distributed.get_world_size(group) if sharded and group is not None else 1
    if size == 1:
        return logits.argmax(dim=-1)
    values, index = logits.max(dim=-1)
    all_values = [torch.empty_like(values) for _ in range(size)]
    all_index = [torch.empty_like(index) for _ in range(size)]
    torch.distributed.all_gather(all_values, values, group=group)
    torch.distributed.all_gather(all_index, index, group=group)
    winner = torch.stack(all_values).argmax(dim=0)
    local = torch.stack(all_index).gather(0, winner.unsqueeze(0)).squeeze(0)
    return winner * logits.size(-1) + local


def running_means(recorders: list[Recorder], reset: bool) -> dict[str, MTPMetrics]:
    """The running means by phase over ``recorders`` (their sums added: token-weighted). Models
    of different MTP depth add up depth by depth; a depth only some have counts only theirs."""
    combined: dict[str, tuple[torch.Tensor, int]] = {}
    for recorder in recorders:
        for phase, (sums, forwards) in recorder.take(reset).items():
            seen = combined.get(str(phase))
            if seen is not None:
                sums, forwards = _add_by_depth(seen[0], sums), seen[1] + forwards
            combined[str(phase)] = (sums, forwards)
    return {phase: to_metrics(sums, n) for phase, (sums, n) in sorted(combined.items())}


def _add_by_depth(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a + b`` for ``[6, depths]`` sums, the shallower one padded with zero counts."""
    b = b.to(a.device)
    depths = max(a.shape[1], b.shape[1])
    pad = torch.nn.functional.pad
    return pad(a, (0, depths - a.shape[1])) + pad(b, (0, depths - b.shape[1]))

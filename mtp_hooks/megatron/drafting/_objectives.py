"""What MTP trains toward: the policy's own next-token distribution (``kl``, ``tv``).

megatron's MTP loss is a cross-entropy against the data's labels. A drafter is judged by how
often the *policy* would produce what it drafts, and in RL the data are the policy's own
samples: a noisy target, and a stale one right after the policy moves. ``+objective:kl`` and
``+objective:tv`` train each depth's draft distribution toward the policy's own detached
next-token distribution at the position it drafts for, with no edit to megatron:

* The call runs with megatron's MTP loss weight set to 0 (the config view that carries a
  weight), so megatron's cross-entropy still runs, forward and backward, but adds nothing to
  any gradient. That is its whole cost: a cross-entropy per depth.
* megatron's own projections, one per depth inside ``process_mtp_loss`` and then the
  policy's, are read as they are made (:mod:`._projections`): no extra projection is made.
  At the policy's, it computes the objective from the depths' logits and the policy's
  (detached, at the given temperature, rolled along the sequence by the depth exactly as
  megatron rolls labels: context parallelism and packed sequences included), weighted and
  normalised exactly as megatron weights its MTP loss. The model's forward then returns its
  output through megatron's own ``MTPLossAutoScaler`` carrying the objective, so the backward
  of whatever the caller computes from it also trains MTP. (Not the logits themselves:
  megatron's cross-entropy changes them in place, which autograd forbids on the output of
  such a function.)
* ``kl`` and ``tv`` need ``+detach``: megatron then detaches MTP's inputs, embeddings and
  output weight, so the objective trains the MTP weights alone and the policy's update stays
  that of a skip.

Under tensor parallelism the logits may be split along the vocabulary; the softmaxes and the
objective's sums then reduce over the tensor-parallel group (:mod:`._vocab_parallel`).
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from megatron.core.transformer import multi_token_prediction as _mtp

from ..._errors import UnsupportedModelError
from . import _depth_figures, _vocab_parallel
from ._loss_request import Request, loss_request
from ._projections import shared

if TYPE_CHECKING:
    from .._call_extensions import Extensions, PlannedCall


@dataclass
class Call:
    """One forward that trains MTP toward the policy: what it needs, and the depths' logits
    the output layer has produced so far."""

    request: Request
    kind: str
    temperature: float
    factor: float
    drafts: list[torch.Tensor] = field(default_factory=list)
    """Each depth's draft log-probabilities so far, ``[s, b, v]`` (float32, with their graph)."""
    loss: torch.Tensor | None = None


class Objectives:
    """The objective calls of one gated model, by thread; they hear megatron's projections
    through the model's :class:`~._projections.Projections` while a call is open. The per-call
    extension of ``+objective`` (:mod:`mtp_hooks.megatron._call_extensions`)."""

    ends: ClassVar[bool] = True

    def __init__(self, model: torch.nn.Module, extensions: Extensions) -> None:
        self.projections = shared(model, extensions)
        self.lock = threading.Lock()
        self.calls: dict[int, Call] = {}

    def begin(
        self,
        model: Any,
        plan: PlannedCall,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        config: Any,
    ) -> None:
        """Open this thread's call of ``model`` (starting now), weighted as megatron would
        weight its MTP loss: the plan's weight, else the model's own (``config``). A call
        without autograd, or whose MTP loss megatron does not compute, opens nothing."""
        options = plan.options
        if not torch.is_grad_enabled() or options.objective is None:
            return
        request = loss_request(model, plan.phase, args, kwargs)
        if request is None:  # megatron computes no MTP loss in this call: nothing to replace
            return
        kind, temperature = options.objective, options.temperature
        factor = options.loss_scale
        if factor is None:
            factor = config.mtp_loss_scaling_factor
        with self.lock:
            self.calls[threading.get_ident()] = Call(request, kind, temperature, factor)
        self.projections.listen(model, self)

    def end(self, model: Any, output: Any) -> Any:
        """Close this thread's call, whether or not its forward completed; return the output
        carrying the objective it computed into the backward, if it got that far."""
        loss = self.close()
        if loss is None or output is None:
            return None
        return attach(output, loss)

    def close(self) -> torch.Tensor | None:
        """Close this thread's call; the objective it computed, if any."""
        with self.lock:
            call = self.calls.pop(threading.get_ident(), None)
        self.projections.stop(self)
        return None if call is None else call.loss

    def cancel(self) -> None:
        """Close the call an interrupted forward of this thread left open."""
        self.close()

    def drop_all(self) -> None:
        """Close every call (no call of the model runs: what interrupted calls left)."""
        with self.lock:
            self.calls.clear()
        self.projections.forget(self)

    def depth(self, model: Any, depth: int, logits: torch.Tensor) -> None:
        """A depth's projection, inside ``process_mtp_loss``: taken now, as log-probabilities,
        because megatron's cross-entropy overwrites these logits in place right after."""
        call = self._call()
        if call is not None:
            group = _vocab_parallel.group_of(model, call.request.runtime_gather_output)
            scaled = _vocab_parallel.mup_scaled(model, logits).float() / call.temperature
            call.drafts.append(_vocab_parallel.log_softmax(scaled, group))

    def policy(self, model: Any, logits: torch.Tensor) -> None:
        """The policy's projection: the objective of every depth taken so far."""
        call = self._call()
        if call is not None and call.loss is None:
            call.loss = objective_loss(model, call, _vocab_parallel.mup_scaled(model, logits))
            call.drafts.clear()

    def _call(self) -> Call | None:
        with self.lock:
            return self.calls.get(threading.get_ident())

    def __deepcopy__(self, memo: dict[int, Any]) -> Objectives:
        """A copied model opens no call of the original's (its gate starts without one)."""
        new = object.__new__(Objectives)
        new.lock, new.calls = threading.Lock(), {}
        new.projections = copy.deepcopy(self.projections, memo)
        return new


def attach(output: Any, loss: torch.Tensor) -> Any:
    """``output`` carrying ``loss`` into the backward (megatron's ``MTPLossAutoScaler``, scaled
    as megatron scales its own MTP loss)."""
    if not isinstance(output, torch.Tensor):
        raise UnsupportedModelError(
            "mtp_hooks: the policy trains MTP toward the policy's own distribution, which rides "
            f"on the model's output into the backward, but this forward returned a "
            f"{type(output).__name__}, not a tensor. Use objective 'ce' for this model"
        )
    return _mtp.MTPLossAutoScaler.apply(output, loss)


def objective_loss(model: Any, call: Call, policy: torch.Tensor) -> torch.Tensor:
    """The objective of every depth against ``policy``'s logits ``[s, b, v]``, weighted and
    normalised as ``process_mtp_loss`` weights its cross-entropy (a scalar)."""
    request, depths = call.request, len(call.drafts)
    roll = _depth_figures.roller(model, request)
    group = _vocab_parallel.group_of(model, request.runtime_gather_output)
    with torch.no_grad():
        log_probs = _vocab_parallel.log_softmax(policy.detach().float() / call.temperature, group)
        _, mask = _depth_figures.labels_and_mask(request, roll)
        original = mask.sum()
    scale = call.factor / depths
    per_token = bool(getattr(model.config, "calculate_per_token_loss", False))
    total = policy.new_zeros((), dtype=torch.float32)
    ahead = _depth_figures.policy_ahead(log_probs, depths, roll)
    for log_q in call.drafts:
        with torch.no_grad():
            log_p = next(ahead)  # position i: the policy at i + depth
            mask, count = roll(mask)
        if call.kind == "kl":  # sum p (log p - log q): its gradient in the logits is (q - p) / T
            per = torch.sum(log_p.exp() * (log_p - log_q), dim=-1)
        else:  # sum |q - p| / 2
            per = torch.sum((log_q.exp() - log_p.exp()).abs(), dim=-1) / 2
        loss = torch.sum(mask.t().float() * _vocab_parallel.sum_over(per, group))
        if per_token:
            total = total + scale * loss * (original / count.clamp(min=1))
        else:
            total = total + scale * loss / count.clamp(min=1)
    return total

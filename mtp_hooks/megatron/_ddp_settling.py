"""What a skipped forward owes Megatron's DDP: a zero gradient for each MTP-only parameter, and
the parameter all-gathers its MTP block would have waited for.

* **``overlap_grad_reduce``**: DDP waits, in the synchronising microbatch, for a gradient of
  every parameter that requires one. A skipped forward therefore attaches a zero-valued
  autograd dependency on every MTP-only parameter to the model output, so each gets a zero
  gradient and its bucket is issued (docs/hazards.md, section 4).
* **``overlap_param_gather``** starts all-gathers from forward pre-hooks; a skipped MTP block
  would leave its bucket group's gather outstanding, so it is finished here.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

from .. import _runtime
from .._errors import UnsupportedModelError
from ._capabilities import mtp_only_parameters


class _ZeroGradDependency(torch.autograd.Function):
    """Returns ``output`` unchanged; in backward, gives each extra input a zero gradient."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.param_meta = [(p.shape, p.dtype, p.device) for p in params]
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, ...]:
        zeros = tuple(
            torch.zeros((), dtype=dtype, device=device).expand(shape)
            for shape, dtype, device in ctx.param_meta
        )
        return (grad_output, *zeros)


def megatron_ddps(wrappers: list[torch.nn.Module]) -> list[Any]:
    """The Megatron ``DistributedDataParallel`` wrappers among ``wrappers`` (duck-typed)."""
    return [w for w in wrappers if hasattr(w, "param_to_bucket_group") and hasattr(w, "ddp_config")]


def mtp_param_gather_groups(
    ddps: list[Any], params: list[tuple[str, torch.nn.Parameter]]
) -> list[Any]:
    """The bucket groups holding MTP parameters whose all-gather DDP starts from forward hooks.

    DDP fixes its buckets when it is built, so this is computed once, at attach time.
    """
    groups: dict[int, Any] = {}
    for ddp in ddps:
        if getattr(ddp.ddp_config, "overlap_param_gather", False) and getattr(
            ddp, "use_forward_hook", False
        ):
            for _, p in params:
                if (group := ddp.param_to_bucket_group.get(p)) is not None:
                    groups[id(group)] = group
    return list(groups.values())


class DDPState:
    """What a skipped forward owes the DDP wrappers around one model, fixed at attach time.

    It holds the MTP-only parameters and the DDP bucket groups they sit in, never the model or
    the wrappers, so an attached model is freed as soon as its user drops it.
    """

    def __init__(self, model: torch.nn.Module, wrappers: list[torch.nn.Module]):
        ddps = megatron_ddps(wrappers)
        self._model = weakref.ref(model)
        self.megatron = bool(ddps)
        self.wrapped = self.megatron or any(
            isinstance(w, torch.nn.parallel.DistributedDataParallel) for w in wrappers
        )
        self.gather_groups = (
            mtp_param_gather_groups(ddps, mtp_only_parameters(model)) if ddps else []
        )

    @functools.cached_property
    def params(self) -> list[torch.nn.Parameter]:
        """The MTP-only parameters (found at first use: a deep copy is still being built)."""
        model = self._model()
        return [p for _, p in mtp_only_parameters(model)] if model is not None else []

    def check_skip(self) -> bool:
        """Refuse a skip on a bare model whose MTP parameters sit in a Megatron DDP buffer;
        return whether a skipped forward owes DDP anything (:meth:`after_skipped_forward`)."""
        params = self.params
        in_buffer = bool(params) and hasattr(params[0], "main_grad")
        if in_buffer and not self.megatron:
            raise UnsupportedModelError(
                "mtp_hooks: this model's MTP parameters are in a Megatron DDP gradient buffer, "
                "but mtp_hooks was attached to the bare model, so a skipped forward cannot "
                "settle DDP's param all-gathers (with overlap_param_gather=True the next step "
                "fails on 'param_gather_handle is None'). Attach the DDP wrapper instead: "
                "mtp_hooks.attach(ddp_model), or freeze MTP with "
                "mtp_hooks.megatron.freeze_mtp() before wrapping."
            )
        return bool(params) and (self.wrapped or in_buffer)

    def after_skipped_forward(self, output: Any) -> Any:
        """Settle param gathers and gradient buckets for the MTP parameters a skip left unused."""
        for group in self.gather_groups:
            group.finish_param_sync(skip_next_bucket_dispatch=True)
        params = self.params
        if not torch.is_grad_enabled() or not params:
            return None
        # Megatron DDP sets main_grad on every parameter it manages; torch DDP is seen at attach.
        under_ddp = self.wrapped or hasattr(params[0], "main_grad")
        needing = [p for p in params if p.requires_grad] if under_ddp else None
        if not needing:
            return None
        if not (torch.is_tensor(output) and output.requires_grad):
            _runtime.warn_once(
                "mtp_hooks: MTP was skipped under DDP but the model output is not a tensor that "
                "requires grad, so the MTP parameters get no zero gradient; with "
                "overlap_grad_reduce=True the grad sync may fail. Use "
                "mtp_hooks.megatron.freeze_mtp(model) before wrapping in DDP to take MTP out of "
                "the gradient buckets."
            )
            return None
        from megatron.core.utils import make_viewless_tensor

        out = _ZeroGradDependency.apply(output, *needing)
        return make_viewless_tensor(out, requires_grad=True, keep_graph=True)

"""What is done to a model's parameters before DDP wraps them: freezing MTP or the trunk, to
train one side alone, and putting the MTP weights in a gradient-norm group of their own, so that
megatron's optimizer clips them apart from the trunk. Each refuses a model already wrapped.
"""

from __future__ import annotations

from typing import Any

import torch

from .._errors import UnsupportedModelError
from . import _capabilities
from ._capabilities import has_mtp, mtp_only_parameters
from ._ddp_settling import megatron_ddps


def freeze_mtp_parameters(
    models: list[torch.nn.Module], wrappers: list[torch.nn.Module]
) -> list[str]:
    """Set ``requires_grad=False`` on every MTP-only parameter and freeze MTP routers' expert bias.

    Refuses, changing nothing, an already wrapped model and an MoE MTP router whose expert bias
    this megatron-core cannot hold still.
    """
    params = [named for m in models if has_mtp(m) for named in mtp_only_parameters(m)]
    routers = [r for m in models if has_mtp(m) for r in mtp_routers_with_expert_bias(m)]
    wrapped = bool(wrappers) or any(hasattr(p, "main_grad") for _, p in params)
    return _freeze(
        "freeze_mtp",
        "the MTP block",
        params,
        routers,
        wrapped,
        ", or skip MTP by policy instead (a skipped router counts no tokens, so its bias does "
        "not move)",
    )


def freeze_trunk_parameters(
    models: list[torch.nn.Module], wrappers: list[torch.nn.Module]
) -> list[str]:
    """Set ``requires_grad=False`` on every parameter that is not MTP-only, and freeze the
    expert bias of the trunk's MoE routers: the mirror of :func:`freeze_mtp_parameters`, with
    the same refusals, and one more: a model without MTP."""
    if not any(has_mtp(m) for m in models):
        raise UnsupportedModelError(
            "mtp_hooks.megatron.freeze_trunk: the model has no MTP block on this rank, so it "
            "would freeze every parameter. Call it on a model built with mtp_num_layers > 0 (on "
            "pipeline stages without MTP there is nothing to train in MTP-only training)."
        )
    keep = {id(p) for m in models if has_mtp(m) for _, p in mtp_only_parameters(m)}
    params = [(name, p) for m in models for name, p in m.named_parameters() if id(p) not in keep]
    in_mtp = {id(r) for m in models if has_mtp(m) for r in mtp_routers_with_expert_bias(m)}
    routers = [
        r
        for m in models
        for r in m.modules()
        if getattr(r, "expert_bias", None) is not None and id(r) not in in_mtp
    ]
    wrapped = bool(wrappers) or any(hasattr(p, "main_grad") for m in models for p in m.parameters())
    return _freeze("freeze_trunk", "the trunk", params, routers, wrapped)


def mtp_grad_norm_group_or_refuse() -> str:
    """The gradient-norm group megatron's optimizer clips MTP weights in.

    Raises:
        UnsupportedModelError: This megatron-core's optimizer has no separate groups.
    """
    group = _capabilities.mtp_grad_norm_group()
    if group is None:
        raise UnsupportedModelError(
            "mtp_hooks.megatron.clip_mtp_apart: this megatron-core's optimizer has no separate "
            "gradient-norm groups (megatron.core.optimizer.optimizer.SEPARATE_GRAD_NORM_GROUPS "
            "came in megatron-core 0.19), so it always clips MTP's gradients together with the "
            "trunk's. Upgrade megatron-core (0.17 and later need Python 3.12), or clip the "
            "trunk's and MTP's gradients apart in your own optimizer step."
        )
    return group


def clip_mtp_apart_parameters(
    models: list[torch.nn.Module],
    wrappers: list[torch.nn.Module],
    blocks: tuple[torch.nn.Module, ...] = (),
) -> list[str]:
    """Put every parameter of each model's MTP block in megatron's MTP gradient-norm group, as
    megatron tags them when a model is built with ``mtp_detach_heads=True``.

    Refuses, changing nothing, where this megatron-core's optimizer has no such group, where
    the model is already wrapped in DDP (an optimizer may already have copied the parameters'
    tags), and where a parameter already belongs to another group. ``blocks`` are MTP blocks
    given directly (auto-attach tags a block as it is assigned, before ``model.mtp`` exists).
    """
    group = mtp_grad_norm_group_or_refuse()
    params = [
        (f"mtp.{n}", p) for m in models if has_mtp(m) for n, p in _block(m).named_parameters()
    ] + [(f"mtp.{n}", p) for block in blocks for n, p in block.named_parameters()]
    wrapped = any(hasattr(p, "main_grad") for _, p in params) or any(
        isinstance(w, torch.nn.parallel.DistributedDataParallel) for w in wrappers
    )
    if wrapped or megatron_ddps(wrappers):
        raise UnsupportedModelError(
            "mtp_hooks.megatron.clip_mtp_apart must be called before the model is wrapped in DDP: "
            "megatron's optimizer copies each parameter's gradient-norm group when it is built "
            "over the wrapped model, and a tag set after that is not seen. Call it on the bare "
            "GPTModel/HybridModel, then wrap it and build the optimizer."
        )
    attr = _capabilities.GRAD_NORM_GROUP_ATTR
    others = [(n, g) for n, p in params if (g := getattr(p, attr, None)) not in (None, group)]
    if others:
        listed = ", ".join(f"{n} ({g!r})" for n, g in others[:3])
        raise UnsupportedModelError(
            "mtp_hooks.megatron.clip_mtp_apart: MTP parameters already belong to another "
            f"gradient-norm group: {listed}. Remove that tag first, or leave the grouping to it."
        )
    for _, param in params:
        setattr(param, attr, group)
    return [name for name, _ in params]


def _freeze(
    name: str,
    part: str,
    params: list[tuple[str, torch.nn.Parameter]],
    routers: list[Any],
    wrapped: bool,
    other_fix: str = "",
) -> list[str]:
    """Freeze ``params`` and the expert bias of ``routers`` (``part`` of the model), or refuse
    for ``mtp_hooks.<name>``, changing nothing, what cannot be frozen."""
    if wrapped:
        raise UnsupportedModelError(
            f"mtp_hooks.{name} must be called before the model is wrapped in DDP: the wrapper "
            f"has already put the parameters of {part} in its gradient buckets. Call {name} on "
            "the bare GPTModel/HybridModel, then wrap it."
        )
    if any(not hasattr(r, "frozen_expert_bias") for r in routers):
        raise UnsupportedModelError(
            f"mtp_hooks.{name}: {part} has MoE routers with an expert bias "
            "(moe_router_enable_expert_bias=True), which finalize_model_grads moves whenever the "
            "module is in training mode, and this megatron-core's router has no "
            "frozen_expert_bias flag to stop it, so they cannot be frozen. Use a megatron-core "
            "whose TopKRouter has frozen_expert_bias (0.19 has it), set "
            f"moe_router_enable_expert_bias=False{other_fix}."
        )
    for _, param in params:
        param.requires_grad_(False)
    for router in routers:
        router.frozen_expert_bias = True
    return [name for name, _ in params]


def mtp_routers_with_expert_bias(model: Any) -> list[Any]:
    """The MoE routers inside ``model.mtp`` that carry an ``expert_bias`` buffer."""
    return [m for m in model.mtp.modules() if getattr(m, "expert_bias", None) is not None]


def _block(model: Any) -> torch.nn.Module:
    """``model.mtp``, the MTP block of a model that has one."""
    block: torch.nn.Module = model.mtp
    return block

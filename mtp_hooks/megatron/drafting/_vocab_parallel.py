"""Top-1 tokens, softmaxes and sums over a vocabulary that tensor parallelism may split across
ranks, of logits scaled as megatron scales what it trains on (:func:`mup_scaled`).

With ``runtime_gather_output`` off (megatron's training default), each tensor-parallel rank
holds its shard of the logits' last dimension. These helpers reduce over the group where that
is so, and are plain torch where each rank has the whole vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch


def group_of(model: Any, gather: bool | None) -> Any:
    """The tensor-parallel group the vocabulary is split over, or ``None`` when each rank has
    all of it (gathered logits, or one rank)."""
    sharded = (not gather) if gather is not None else not model.output_layer.gather_output
    group = getattr(model, "tp_group", None)
    if not sharded or group is None or torch.distributed.get_world_size(group) == 1:
        return None
    return group


def mup_scaled(model: Any, logits: torch.Tensor) -> torch.Tensor:
    """``logits`` scaled as megatron scales what it trains on (MuP), else as they are."""
    if getattr(model.config, "use_mup", False):
        scaled: torch.Tensor = model._scale_logits(logits)
        return scaled
    return logits


def own_shard(logits: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's shard of whole-vocabulary ``logits`` (megatron's even split of the padded
    vocabulary along the last dimension), or ``logits`` where ``group`` is ``None``."""
    if group is None:
        return logits
    size, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    return logits.chunk(size, dim=-1)[rank]


def top1(model: Any, logits: torch.Tensor, gather: bool | None) -> torch.Tensor:
    """``[s, b]`` global top-1 token ids; exact when the vocab is split across TP ranks.

    Each rank contributes its shard's maximum and its index; the first rank holding the global
    maximum wins, which is the tie rule of ``argmax`` over the whole vocabulary (and of
    Megatron's own acceptance count).
    """
    group = group_of(model, gather)
    if group is None:
        return logits.argmax(dim=-1)
    size = torch.distributed.get_world_size(group)
    values, index = logits.max(dim=-1)
    all_values = [torch.empty_like(values) for _ in range(size)]
    all_index = [torch.empty_like(index) for _ in range(size)]
    torch.distributed.all_gather(all_values, values, group=group)
    torch.distributed.all_gather(all_index, index, group=group)
    winner = torch.stack(all_values).argmax(dim=0)
    local = torch.stack(all_index).gather(0, winner.unsqueeze(0)).squeeze(0)
    return winner * logits.size(-1) + local


def _all_reduce(tensor: torch.Tensor, group: Any, op: Any = None) -> torch.Tensor:
    torch.distributed.all_reduce(tensor, op=op or torch.distributed.ReduceOp.SUM, group=group)
    return tensor


def log_softmax(logits: torch.Tensor, group: Any) -> torch.Tensor:
    """``log_softmax`` over the last dimension, which may be split over ``group``."""
    if group is None:
        return torch.log_softmax(logits, dim=-1)
    out: torch.Tensor = _VocabParallelLogSoftmax.apply(logits, group)
    return out


def sum_over(partial: torch.Tensor, group: Any) -> torch.Tensor:
    """Sums of vocabulary shards (each rank's partial sum) added over ``group``."""
    if group is None:
        return partial
    out: torch.Tensor = _SumOverShards.apply(partial, group)
    return out


class _VocabParallelLogSoftmax(torch.autograd.Function):
    """``log_softmax`` of logits split along the vocabulary over a tensor-parallel group."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, group: Any) -> torch.Tensor:
        top = logits.max(dim=-1, keepdim=True).values
        shifted = logits - _all_reduce(top, group, torch.distributed.ReduceOp.MAX)
        out = shifted - _all_reduce(shifted.exp().sum(dim=-1, keepdim=True), group).log()
        ctx.save_for_backward(out)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (out,) = ctx.saved_tensors
        total = _all_reduce(grad.sum(dim=-1, keepdim=True), ctx.group)
        return grad - out.exp() * total, None


class _SumOverShards(torch.autograd.Function):
    """An all-reduce sum whose gradient passes through unchanged: each rank's shard
    contributes its own part of the sum."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, group: Any) -> torch.Tensor:
        return _all_reduce(partial.clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad, None

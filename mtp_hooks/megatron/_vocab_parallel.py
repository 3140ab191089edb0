"""Softmaxes and sums over a vocabulary that tensor parallelism may split across ranks.

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

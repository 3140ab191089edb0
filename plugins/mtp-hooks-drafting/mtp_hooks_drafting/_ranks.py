"""Figures summed over the ranks that compute them, so that every rank decides alike."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def sum_over_ranks(total: tuple[float, ...], group: Any) -> tuple[float, ...]:
    """Sum ``total`` over ``group`` (every rank gets the same sums); as is without a group."""
    try:
        import torch
    except ImportError:
        return total
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return total
    if group is None:
        group = _data_parallel_group()
    device: Any = "cpu"
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    tensor = torch.tensor(total, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, group=group)
    return tuple(tensor.tolist())


def _data_parallel_group() -> Any:
    """megatron's data-parallel group where megatron is initialized, else the default group."""
    try:
        from megatron.core import parallel_state
    except ImportError:
        return None
    initialized: Callable[[], bool] = parallel_state.model_parallel_is_initialized
    return parallel_state.get_data_parallel_group() if initialized() else None

"""Rank agreement (``verify=True`` or ``MTP_HOOKS_VERIFY=1``): every rank that must take the
same decision checks it with one small all-gather, and on a mismatch every rank raises
:class:`mtp_hooks.DecisionMismatchError`; no rank is left waiting in a collective.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .._errors import DecisionMismatchError

if TYPE_CHECKING:
    from .._decision import Decision


def _groups(phase: Any) -> Any:
    try:
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            return None
        if str(phase) == "train":
            return ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
        return ps.get_tensor_and_context_parallel_group()
    except (ImportError, AssertionError, AttributeError):
        return None


def verify(decision: Decision, phase: Any) -> None:
    """Check with one all-gather that every rank that must agree reached the same decision.

    The ranks are this stage's tensor- and context-parallel peers, plus the data-parallel peers
    in training (their gradient buckets must match). On a mismatch, every rank gathers the
    details and raises :class:`DecisionMismatchError`; no rank is left waiting.
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return
    group = _groups(phase)
    size = dist.get_world_size(group)
    if size == 1:
        return
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(group) == "nccl"
        else torch.device("cpu")
    )
    mine = torch.tensor([1 if decision.run else 0], dtype=torch.int32, device=device)
    votes = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(votes, mine, group=group)
    if len({int(v.item()) for v in votes}) == 1:
        return
    details: list[Any] = [None] * size
    me = (dist.get_rank(), decision.run, decision.decided_by)
    dist.all_gather_object(details, me, group=group)
    listed = "; ".join(
        f"rank {r}: {'run' if run else 'skip'} (decided by {by})" for r, run, by in details
    )
    raise DecisionMismatchError(
        f"ranks disagree on MTP for phase {str(phase)!r}: {listed}. Policies must be "
        "deterministic functions of state every rank shares (phase, config, step); fix the "
        "rank-dependent plugin or set this phase in the policy config."
    )

"""The figures of one recorded forward: per MTP depth, its loss, top-1 hits and positions, the
chained hits, and the greedy engine's walk over them; and their means.

:class:`~mtp_hooks.megatron._recorder.Recorder` hands each forward's MTP hidden states here.
Everything stays on the device as one ``[ROWS, depths]`` tensor per forward, summed per phase,
until :func:`to_metrics` reads it (one host sync).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.transformer import multi_token_prediction as _mtp

from ..._metrics import MTPMetrics
from . import _vocab_parallel
from ._engine_walk import engine_walk, expected_walk
from ._loss_request import Request
from ._single_position import single_position_logits


def roller(model: Any, request: Request) -> Callable[[torch.Tensor], Any]:
    """megatron's one-position left roll along this call's sequence, as ``process_mtp_loss``
    rolls its labels: ``roll_tensor`` with the model's context-parallel group and the call's
    packed sequences. Returns ``(rolled, its sum)``."""
    cp_group, psp = model.cp_group, request.packed_seq_params

    def roll(tensor: torch.Tensor) -> Any:
        return _mtp.roll_tensor(
            tensor, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=psp
        )

    return roll


def labels_and_mask(request: Request, roll: Callable[[torch.Tensor], Any]) -> tuple[Any, Any]:
    """The labels and loss mask megatron's MTP loss starts from: the call's own, or, without
    labels, ``input_ids`` rolled once (label ``i`` is token ``i + 1``) with the mask rolled in
    step; a missing mask is all ones."""
    labels, mask = request.labels, request.loss_mask
    if labels is None:
        assert request.input_ids is not None  # else megatron computes no MTP loss (no request)
        labels, _ = roll(request.input_ids)
        mask, _ = roll(torch.ones_like(labels) if mask is None else mask)
    elif mask is None:
        mask = torch.ones_like(labels)
    return labels, mask


def policy_ahead(
    log_probs: torch.Tensor, depths: int, roll: Callable[[torch.Tensor], Any]
) -> Iterator[torch.Tensor]:
    """For depth ``d`` = 1 to ``depths``, the policy's ``log_probs`` (``[s, b, v]``) moved so that
    position ``i`` holds those of ``i + d``, the token depth ``d`` at ``i`` drafts for (zero
    where megatron's roll leaves no position)."""
    target = log_probs.permute(1, 2, 0)  # [b, v, s]: megatron rolls the last dimension
    for _ in range(depths):
        target, _ = roll(target)
        yield target.permute(2, 0, 1)


# Rows of a [ROWS, depths] values tensor: per depth the masked loss sum, the top-1 hits, the
# positions that count (mask != 0), then the chained hits (every depth up to this one hit) and the
# chained positions (every depth up to this one has the position), and the mask's sum: a
# weighted mask weighs the loss (megatron's weighted mean), never the acceptance. The last two
# rows hold, in column 0 only, the draft tokens accepted and the verify steps of a greedy
# engine's walk over the positions (see ``engine_walk``).
_LOSS, _CORRECT, _TOKENS, _CHAIN, _CHAIN_POSITIONS, _MASK_SUM = range(6)
_WALK_ACCEPTED, _WALK_STEPS = 6, 7
# Then per depth, under sampled drafts and a sampled target (:func:`sampled_values`): the
# chance that a draft drawn from the depth's distribution equals a token drawn from the policy's,
# summed over the positions that count, the product of those chances along the chain summed
# over the chained positions, and the two position counts (zero when the forward never reached
# the policy's projection). The last two rows hold, in column 0 only, the draft tokens a
# sampling engine's walk accepts and its verify steps, both expected (see ``expected_walk``).
_SAMPLED, _SAMPLED_CHAIN, _SAMPLED_POSITIONS, _SAMPLED_CHAIN_POSITIONS = 8, 9, 10, 11
_SAMPLED_WALK_ACCEPTED, _SAMPLED_WALK_STEPS = 12, 13
# Then, in column 0, both walks again over the drafts of :mod:`._single_position` (greedy, then
# sampled: accepted drafts and verify steps, zero steps where they were not computed).
_SINGLE_WALK_ACCEPTED, _SINGLE_WALK_STEPS = 14, 15
_SINGLE_SAMPLED_WALK_ACCEPTED, _SINGLE_SAMPLED_WALK_STEPS = 16, 17
ROWS = 18


@dataclass
class Drafts:
    """What :func:`sampled_values` needs of one recorded forward, per depth: the depth's logits
    (``[s, b, v]``, this rank's vocabulary shard), the positions that count, and the chained
    positions (each ``[s, b]``)."""

    logits: list[torch.Tensor]
    valid: list[torch.Tensor]
    present: list[torch.Tensor]
    single: list[torch.Tensor] | None = None  # the same depths' drafts, position by position


def to_metrics(values: torch.Tensor, forwards: int) -> MTPMetrics:
    """Means of ``[ROWS, depths]`` sums (see ``_LOSS``) over ``forwards`` (a host sync).

    Divided in ``values``' dtype, so one forward's float32 loss is bit for bit the value
    Megatron logs for it (``sum / num_tokens.clamp(min=1)``, ``num_tokens`` the mask's sum).
    Acceptance is hits over the positions whose mask is not 0, whatever their weight.
    """
    loss = (values[_LOSS] / values[_MASK_SUM].clamp(min=1)).tolist()
    acceptance = (values[_CORRECT] / values[_TOKENS].clamp(min=1)).tolist()
    tokens = [int(n) for n in values[_TOKENS].tolist()]
    chain = (values[_CHAIN] / values[_CHAIN_POSITIONS].clamp(min=1)).tolist()
    accepted = float(values[_WALK_ACCEPTED, 0] / values[_WALK_STEPS, 0].clamp(min=1))
    sampled: list[float] = []
    sampled_chain: list[float] = []
    sampled_length = None
    if bool(values[_SAMPLED_POSITIONS].any()):  # the forwards reached the policy's projection
        sampled = (values[_SAMPLED] / values[_SAMPLED_POSITIONS].clamp(min=1)).tolist()
        positions = values[_SAMPLED_CHAIN_POSITIONS].clamp(min=1)
        sampled_chain = (values[_SAMPLED_CHAIN] / positions).tolist()
        walked = values[_SAMPLED_WALK_STEPS, 0].clamp(min=1e-12)
        sampled_length = float(values[_SAMPLED_WALK_ACCEPTED, 0] / walked)
    single_length, single_sampled_length = (  # None where no single-position walk ran
        float(values[got, 0] / values[steps, 0]) if bool(values[steps, 0] > 0) else None
        for got, steps in (
            (_SINGLE_WALK_ACCEPTED, _SINGLE_WALK_STEPS),
            (_SINGLE_SAMPLED_WALK_ACCEPTED, _SINGLE_SAMPLED_WALK_STEPS),
        )
    )
    return MTPMetrics(
        loss=tuple(loss),
        acceptance=tuple(acceptance),
        tokens=tuple(tokens),
        forwards=forwards,
        chain_acceptance=tuple(chain),
        accepted_length=accepted,
        sampled_acceptance=tuple(sampled),
        sampled_chain_acceptance=tuple(sampled_chain),
        sampled_accepted_length=sampled_length,
        single_position_accepted_length=single_length,
        single_position_sampled_accepted_length=single_sampled_length,
    )


def depth_values(model: Any, request: Request, hidden: torch.Tensor) -> tuple[torch.Tensor, Drafts]:
    """``[ROWS, depths]`` float32: the masked loss sum, top-1 hits and positions of each depth,
    computed the way ``process_mtp_loss`` computes them (same calls, same order), the chained
    hits and positions, and the greedy engine's walk (:func:`engine_walk`); and the drafts
    :func:`sampled_values` reads once the policy's logits exist. Depth ``d`` at position ``i``
    drafts token ``i + d + 1``, so a greedy chain from position ``i`` accepts depths ``1..k``
    when each of them hits at ``i``."""
    depths = model.config.mtp_num_layers
    roll = roller(model, request)
    with torch.no_grad():
        chunks = torch.chunk(hidden, 1 + depths, dim=0)
        labels, mask = labels_and_mask(request, roll)
        weight = model.shared_embedding_or_output_weight() if _tied(model) else None
        single = single_position_logits(
            model, chunks[0], request.input_ids, request.position_ids, roll, weight
        )
        drafts = Drafts([], [], [], single)
        group = _vocab_parallel.group_of(model, request.runtime_gather_output)
        rows = []
        single_run = single_chain = None  # as run and chain, over the single-position drafts
        chain: torch.Tensor | None = None  # [s, b]: every depth so far hit here
        present: torch.Tensor | None = None  # [s, b]: every depth so far has this position
        run = None  # [s, b]: how many depths a greedy chain from here accepts
        region = None  # [s, b]: depth 1 has this position
        for depth in range(depths):
            # .forward, not the module call: a measurement projection must not reach the output
            # layer's hooks, which count megatron's own projections (an objective's would take
            # these for the depths' and megatron's first depth for the policy's)
            logits, _ = model.output_layer.forward(
                chunks[depth + 1],
                weight=weight,
                runtime_gather_output=request.runtime_gather_output,
            )
            logits = _vocab_parallel.mup_scaled(model, logits)
            labels, _ = roll(labels)
            mask, mask_sum = roll(mask)
            draft = _vocab_parallel.top1(model, logits, request.runtime_gather_output)
            # megatron's vocab-parallel cross-entropy overwrites its logits in place, and the
            # sampled figures read these once the policy's logits exist: the loss gets a copy
            loss = torch.sum(mask * model.compute_language_model_loss(labels, logits.clone()))
            valid = mask.t() != 0
            hits = (draft == labels.t()) & valid
            chain = hits if chain is None else chain & hits
            present = valid if present is None else present & valid
            run = chain.long() if run is None else run + chain.long()
            region = valid if region is None else region
            if single is not None:
                hit = (_vocab_parallel.top1(model, single[depth], True) == labels.t()) & valid
                single_chain = hit if single_chain is None else single_chain & hit
                more = single_chain.long()
                single_run = more if single_run is None else single_run + more
                # kept for the sampled figures as the depths' own are: this rank's shard
                single[depth] = _vocab_parallel.own_shard(single[depth], group)
            drafts.logits.append(logits)
            drafts.valid.append(valid)
            drafts.present.append(present)
            rows.append(
                torch.stack(
                    [
                        loss.float(),
                        hits.sum().float(),
                        valid.sum().float(),
                        chain.sum().float(),
                        present.sum().float(),
                        mask_sum.float(),
                        *torch.zeros(ROWS - 6, device=loss.device),
                    ]
                )
            )
        values = torch.stack(rows, dim=1)
        if run is not None and region is not None:
            accepted, steps = engine_walk(run.t(), region.t())
            values[_WALK_ACCEPTED, 0], values[_WALK_STEPS, 0] = accepted, steps
        if single_run is not None and region is not None:
            accepted, steps = engine_walk(single_run.t(), region.t())
            values[_SINGLE_WALK_ACCEPTED, 0], values[_SINGLE_WALK_STEPS, 0] = accepted, steps
        return values, drafts


def sampled_values(
    model: Any, request: Request, drafts: Drafts, policy: torch.Tensor
) -> torch.Tensor:
    """``[ROWS, depths]``, zero but for the sampled rows: what megatron's engine accepts when it
    rolls out by sampling at temperature 1. It *samples* each draft from the depth's
    distribution ``q`` (with the rollout's sampling parameters), samples the target from the
    policy's ``p``, and accepts a draft only when the two are equal: at depth ``d`` and
    position ``i`` that happens with chance ``sum_x q(x) p_{i+d}(x)``. ``p`` comes from
    ``policy``, the logits megatron's own projection of the forward gave (no projection of
    ours); a chain takes the product along it, each depth read at the sequence's own tokens.
    The accepted length follows the engine's walk over those chances (:func:`expected_walk`)."""
    depths = len(drafts.logits)
    with torch.no_grad():
        group = _vocab_parallel.group_of(model, request.runtime_gather_output)
        log_probs = _vocab_parallel.log_softmax(
            _vocab_parallel.mup_scaled(model, policy).float(), group
        )
        values = torch.zeros(ROWS, depths, device=policy.device)
        chain = single_chain = None
        chains = []  # per depth, [s, b]: the chance a chain from here accepts depths 1..d
        single_chains = []  # the same, over the drafts computed position by position
        ahead = policy_ahead(log_probs, depths, roller(model, request))

        def chance(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            # sum_x q(x) p(x): a draft sampled from logits equals the policy's sampled token
            draft = _vocab_parallel.log_softmax(logits.float(), group)
            return _vocab_parallel.sum_over((draft + target).exp().sum(dim=-1), group)

        for depth, target in enumerate(ahead):
            accept = chance(drafts.logits[depth], target)
            chain = accept if chain is None else chain * accept
            valid, present = drafts.valid[depth], drafts.present[depth]
            if drafts.single is not None:
                agree = chance(drafts.single[depth], target)
                single_chain = agree if single_chain is None else single_chain * agree
                single_chains.append(single_chain * present)
            values[_SAMPLED, depth] = (accept * valid).sum()
            chains.append(chain * present)
            values[_SAMPLED_CHAIN, depth] = chains[-1].sum()
            values[_SAMPLED_POSITIONS, depth] = valid.sum()
            values[_SAMPLED_CHAIN_POSITIONS, depth] = present.sum()
        if chains:
            accepted, steps = expected_walk(
                torch.stack(chains, dim=-1).transpose(0, 1), drafts.valid[0].t()
            )
            values[_SAMPLED_WALK_ACCEPTED, 0], values[_SAMPLED_WALK_STEPS, 0] = accepted, steps
        if single_chains:
            accepted, steps = expected_walk(
                torch.stack(single_chains, dim=-1).transpose(0, 1), drafts.valid[0].t()
            )
            values[_SINGLE_SAMPLED_WALK_ACCEPTED, 0] = accepted
            values[_SINGLE_SAMPLED_WALK_STEPS, 0] = steps
        return values


def _tied(model: Any) -> bool:
    return bool(getattr(model, "share_embeddings_and_output_weights", False))


def add_by_depth(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a + b`` for ``[ROWS, depths]`` sums, the shallower one padded with zero counts."""
    b = b.to(a.device)
    depths = max(a.shape[1], b.shape[1])
    pad = torch.nn.functional.pad
    return pad(a, (0, depths - a.shape[1])) + pad(b, (0, depths - b.shape[1]))

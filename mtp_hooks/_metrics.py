"""The MTP quality metrics a recorded forward reports: loss and top-1 acceptance per MTP depth."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MTPMetrics:
    """MTP loss and top-1 acceptance per MTP depth, over forwards of one phase on this rank.

    Index ``0`` of each tuple is depth 1 (the MTP layer that predicts the token after the next
    one), as in Megatron's ``mtp_1 loss``.

    Attributes:
        loss: The MTP cross-entropy, averaged over the loss-masked positions the depth predicts
            (for one forward: exactly the value Megatron's ``MTPLossLoggingHelper`` records for
            it in training mode).
        acceptance: The fraction of those positions where the depth's top-1 token is the token
            it predicts: the draft acceptance rate of greedy speculative decoding.
        tokens: The number of those positions, to weight a reduction across ranks.
        forwards: The number of forwards recorded.
        chain_acceptance: Per depth ``k``, the fraction of positions where depths ``1..k`` all
            hit: what a rollout engine that drafts ``k`` tokens with greedy verification sees
            accepted in full. Depth 1's equals its ``acceptance``.
        accepted_length: The draft tokens a greedy engine drafting every depth accepts per
            verify step over these tokens (``0`` to the MTP depth), the engine's own figure:
            it verifies at a region's first position and goes on after the tokens it accepted,
            so a position inside an accepted chain is never a verify step.
        sampled_acceptance: Per depth, the mean chance that a draft sampled from the depth's
            distribution equals a token sampled from the policy's at the position it drafts
            for (``sum_x q(x) p(x)``, both at temperature 1): the acceptance of megatron's
            engine when it rolls out by sampling, since it samples its drafts with the
            rollout's sampling parameters and accepts only an exact match. Empty where nothing
            recorded it (figures from an engine's counters).
        sampled_chain_acceptance: Per depth ``k``, the mean product of those chances for
            depths ``1..k``: the chance a sampling engine accepts the first ``k`` drafts.
        sampled_accepted_length: The draft tokens a sampling engine expects to accept per
            verify step, or ``None`` where nothing recorded it. Like ``accepted_length``, it
            follows the engine's walk: a position counts with the chance that the engine
            verifies there, and positions inside accepted chains are skipped. So it is not the
            sum of ``sampled_chain_acceptance``, which weighs every position alike and reads
            high wherever easy positions follow each other.
        single_position_accepted_length: ``accepted_length`` over drafts computed the way
            megatron-core's inference engine computes them (``compute_mtp_single_step``,
            0.17 on): each depth runs on the drafted position alone, so its attention sees
            no earlier position of the sequence, where training's MTP forward sees them all.
            It predicts megatron's engine drafting one request at a time; engines that keep
            the MTP layer's own cache (vLLM, SGLang) draft as trained, which
            ``accepted_length`` follows. ``None`` where it was not computed: megatron-core
            without ``compute_mtp_single_step`` (0.16), sequence or context parallelism, FP8 or
            FP4 and CUDA graphs (where the extra forward of the MTP layers it takes would move
            their state or meet another layout), no ``input_ids``, or figures from an engine's
            counters. MoE depths are drafted too, with their routers' buffers restored. Where
            it is computed, it costs one more forward of each MTP layer over the recorded
            positions and one more output projection per depth, under ``no_grad``, and those
            logits wait for the policy's projection beside the depths' own.
        single_position_sampled_accepted_length: ``sampled_accepted_length`` over those
            drafts, or ``None`` where either is missing.

    Example:
        >>> from mtp_hooks import MTPMetrics
        >>> m = MTPMetrics(loss=(2.5, 3.0), acceptance=(0.6, 0.4), tokens=(1000, 990), forwards=2)
        >>> round(m.acceptance[0] * m.tokens[0])  # correct top-1 drafts at depth 1
        600
    """

    loss: tuple[float, ...]
    acceptance: tuple[float, ...]
    tokens: tuple[int, ...]
    forwards: int
    chain_acceptance: tuple[float, ...] = ()
    accepted_length: float = 0.0
    sampled_acceptance: tuple[float, ...] = ()
    sampled_chain_acceptance: tuple[float, ...] = ()
    sampled_accepted_length: float | None = None
    single_position_accepted_length: float | None = None
    single_position_sampled_accepted_length: float | None = None

"""The walk a speculative engine takes over teacher-forced draft chains, greedy or sampling.

``+metrics`` knows, at every position, how many drafts a greedy chain from there accepts. An
engine does not verify at every position: it verifies at the first position it drafts from,
accepts that chain, samples one more token, and verifies next after them. :func:`engine_walk`
follows that walk, so the recorded accepted length is the engine's accepted tokens per verify
step. An engine that samples its drafts and its tokens walks at random; :func:`expected_walk`
takes the expectation of that walk over the same positions.
"""

from __future__ import annotations

import torch


def engine_walk(run: torch.Tensor, region: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft tokens a greedy engine accepts, and its verify steps, over ``[b, s]`` rows.

    ``run[b, i]`` is how many drafts a chain from position ``i`` accepts; ``region`` marks the
    positions the engine drafts from (depth 1 has a label there). The engine verifies at the
    first position of a row it drafts from, accepts ``run`` drafts and samples one more token,
    so its next verify step is at ``i + run + 1``: it never verifies at the positions it
    accepted. Where that step lands on a position it does not draft from (a masked label, the
    end of a packed sequence), it verifies next at the first one after. So a row is one walk:
    a chain that jumps over a hole into the next stretch goes on there, and that stretch's
    first position is not walked from again. Averaging ``run`` over every position instead
    counts each accepted chain once per position it covers, and reads high wherever easy
    positions follow each other (a drafter that predicts padding well, over padding).

    Every walk is followed at once by pointer jumping (``log2(s)`` rounds of gathers on the
    device, no host sync). Under context parallelism each rank walks its own chunks.
    """
    batch, seq = run.shape
    where = torch.arange(seq, device=run.device).expand(batch, seq)
    end = torch.full((batch, 1), seq, device=run.device, dtype=torch.long)  # the terminal slot
    onward = _next_in_region(region)  # [b, s + 1]: the first drafted position at or after
    target = (where + run.long() + 1).clamp(max=seq)
    nxt = torch.cat([torch.where(region, onward.gather(1, target), end.expand(batch, seq)), end], 1)
    accepted = torch.cat([torch.where(region, run.long(), 0), torch.zeros_like(end)], dim=1)
    steps = torch.cat([region.long(), torch.zeros_like(end)], dim=1)
    for _ in range(max(1, seq).bit_length()):
        accepted = accepted + accepted.gather(1, nxt)
        steps = steps + steps.gather(1, nxt)
        nxt = nxt.gather(1, nxt)
    first = onward[:, :1]  # the terminal slot, which holds nothing, for a row without a region
    return accepted.gather(1, first).sum().float(), steps.gather(1, first).sum().float()


def _next_in_region(region: torch.Tensor) -> torch.Tensor:
    """``[b, s + 1]`` long: for each position (and the end), the first position at or after it
    that is in ``region``, or ``s`` where none is."""
    batch, seq = region.shape
    where = torch.arange(seq, device=region.device).expand(batch, seq)
    index = torch.where(region, where, seq)
    index = torch.cat([index, torch.full_like(index[:, :1], seq)], dim=1)
    return torch.flip(torch.cummin(torch.flip(index, [1]), dim=1).values, [1])


def expected_walk(chain: torch.Tensor, region: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a *sampling* engine accepts and how often it verifies, expected, over ``[b, s]`` rows.

    ``chain[b, i, d]`` is the chance that a chain from position ``i`` accepts depths ``1..d+1``
    (zero where a depth has no position); ``region`` marks the positions the engine drafts from.
    Where :func:`engine_walk` knows each chain's length, a sampling engine's walk is random: from
    a verify step at ``i`` it accepts ``n`` drafts with chance ``chain[i, n-1] - chain[i, n]``
    and verifies next at ``i + n + 1``, or, where that position is not in ``region``, at the
    first one after it, as :func:`engine_walk` goes on. The chance ``v(j)`` that ``j`` is a
    verify step is 1 at a row's first position in ``region``; otherwise it is the sum of the
    jumps that land on ``j``, and of those that landed on the positions outside ``region``
    just before it. So ``v`` never exceeds 1, and a position inside an easy stretch, which
    accepted chains jump over, weighs less than a hard one right after a rejection. Returns
    ``(sum v(i) * expected accepted at i, sum v(i))``.

    The recurrence runs as a prefix product of its ``(depth + 3)``-square step matrices, in
    ``log2(s)`` rounds of batched matmuls on the device, in float64.
    """
    if chain.shape[1] == 0:
        zero = chain.new_zeros((), dtype=torch.float32)
        return zero, zero
    visits = verify_chances(chain, region)
    accepted = (visits * chain.to(torch.float64).sum(dim=-1)).sum()  # in float64
    return accepted.float(), visits.sum().float()


def verify_chances(chain: torch.Tensor, region: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` float64: ``v(j)``, the chance that a sampling engine verifies at ``j``
    (:func:`expected_walk`), each in ``[0, 1]``."""
    batch, seq, depth = chain.shape
    jumps = depth + 1  # the farthest jump: every draft accepted, then the sampled token
    inside = region.to(torch.float64)
    reach = torch.cat(
        [inside.unsqueeze(-1), chain.to(torch.float64), inside.new_zeros(batch, seq, 1)], dim=-1
    )  # [b, s, depth + 2]: the chance of accepting at least n drafts, n = 0..depth + 1
    landing = reach[..., :-1] - reach[..., 1:]  # [b, s, jumps]: exactly n accepted
    outside = 1.0 - inside
    first = torch.zeros_like(inside)
    first[:, 0] = 1.0  # the walk begins before the row and carries to its first drafted position
    # The state before position j: v(j-1), ..., v(j-jumps), the chance c(j-1) of having landed
    # on positions outside the region since the last verify step, and 1.
    carry, one = jumps, jumps + 1
    size = jumps + 2
    step = inside.new_zeros(batch, seq, size, size)
    for m in range(1, jumps + 1):  # j gains v(j - m) times the chance of a jump of m
        source = torch.nn.functional.pad(landing[..., m - 1], (m, 0))[:, :seq]
        step[..., 0, m - 1] = inside * source
        step[..., carry, m - 1] = outside * source
    step[..., 0, carry], step[..., carry, carry] = inside, outside
    step[..., 0, one], step[..., carry, one] = inside * first, outside * first
    for row in range(1, jumps):
        step[..., row, row - 1] = 1.0
    step[..., one, one] = 1.0
    offset = 1
    while offset < seq:  # Hillis-Steele: step[j] becomes the product of steps j..0
        later = step[:, offset:] @ step[:, :-offset]
        step = torch.cat([step[:, :offset], later], dim=1)
        offset *= 2
    return step[..., 0, one]  # [b, s]: v(j), from the state before the first position

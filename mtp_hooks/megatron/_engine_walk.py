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
    first position of each region, accepts ``run`` drafts and samples one more token, so its next
    verify step is at ``i + run + 1``: it never verifies at the positions it accepted. Averaging
    ``run`` over every position instead counts each accepted chain once per position it covers,
    and reads high wherever easy positions follow each other (a drafter that predicts padding
    well, over padding).

    Every walk is followed at once by pointer jumping (``log2(s)`` rounds of gathers on the
    device, no host sync). Under context parallelism each rank walks its own chunks, so a chain
    that crosses a chunk boundary restarts there.
    """
    batch, seq = run.shape
    where = torch.arange(seq, device=run.device).expand(batch, seq)
    end = torch.full((batch, 1), seq, device=run.device, dtype=torch.long)  # the terminal slot
    target = where + run.long() + 1
    inside = torch.cat([region, torch.zeros_like(region[:, :1])], dim=1)
    goes_on = region & inside.gather(1, target.clamp(max=seq))
    nxt = torch.cat([torch.where(goes_on, target, end.expand(batch, seq)), end], dim=1)
    accepted = torch.cat([torch.where(region, run.long(), 0), torch.zeros_like(end)], dim=1)
    steps = torch.cat([region.long(), torch.zeros_like(end)], dim=1)
    for _ in range(max(1, seq).bit_length()):
        accepted = accepted + accepted.gather(1, nxt)
        steps = steps + steps.gather(1, nxt)
        nxt = nxt.gather(1, nxt)
    starts = _starts(region)
    return accepted[:, :seq][starts].sum().float(), steps[:, :seq][starts].sum().float()


def _starts(region: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` bool: the first position of each region, where an engine's walk begins."""
    before = torch.cat([torch.zeros_like(region[:, :1]), region[:, :-1]], dim=1)
    return region & ~before


def expected_walk(chain: torch.Tensor, region: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a *sampling* engine accepts and how often it verifies, expected, over ``[b, s]`` rows.

    ``chain[b, i, d]`` is the chance that a chain from position ``i`` accepts depths ``1..d+1``
    (zero where a depth has no position); ``region`` marks the positions the engine drafts from.
    Where :func:`engine_walk` knows each chain's length, a sampling engine's walk is random: from
    a verify step at ``i`` it accepts ``n`` drafts with chance ``chain[i, n-1] - chain[i, n]``
    and verifies next at ``i + n + 1``. The chance ``v(j)`` that ``j`` is a verify step is 1 at
    a region's first position and otherwise the sum of the jumps that land there, so a position
    inside an easy stretch, which accepted chains jump over, weighs less than a hard one right
    after a rejection. Returns ``(sum v(i) * expected accepted at i, sum v(i))``.

    The recurrence runs as a prefix product of its ``(depth + 2)``-square step matrices, in
    ``log2(s)`` rounds of batched matmuls on the device, in float64.
    """
    batch, seq, depth = chain.shape
    if seq == 0:
        zero = chain.new_zeros((), dtype=torch.float32)
        return zero, zero
    jumps = depth + 1  # the farthest jump: every draft accepted, then the sampled token
    inside = region.to(torch.float64)
    reach = torch.cat(
        [inside.unsqueeze(-1), chain.to(torch.float64), inside.new_zeros(batch, seq, 1)], dim=-1
    )  # [b, s, depth + 2]: the chance of accepting at least n drafts, n = 0..depth + 1
    landing = reach[..., :-1] - reach[..., 1:]  # [b, s, jumps]: exactly n accepted
    starts = _starts(region).to(torch.float64)
    size = jumps + 1  # the state: v(j), v(j - 1), ..., v(j - jumps + 1), and 1
    step = inside.new_zeros(batch, seq, size, size)
    for m in range(1, jumps + 1):  # v(j) gains v(j - m) times the chance of a jump of m
        source = torch.nn.functional.pad(landing[..., m - 1], (m, 0))[:, :seq]
        step[..., 0, m - 1] = inside * source
    step[..., 0, jumps] = starts
    for row in range(1, jumps):
        step[..., row, row - 1] = 1.0
    step[..., jumps, jumps] = 1.0
    offset = 1
    while offset < seq:  # Hillis-Steele: step[j] becomes the product of steps j..0
        later = step[:, offset:] @ step[:, :-offset]
        step = torch.cat([step[:, :offset], later], dim=1)
        offset *= 2
    visits = step[..., 0, jumps]  # [b, s]: v(j), from the state before the first position
    accepted = (visits * reach[..., 1:-1].sum(dim=-1)).sum()  # the chain's chances, in float64
    return accepted.float(), visits.sum().float()

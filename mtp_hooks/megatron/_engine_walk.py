"""The walk a greedy speculative engine takes over teacher-forced draft chains.

``+metrics`` knows, at every position, how many drafts a greedy chain from there accepts. An
engine does not verify at every position: it verifies at the first position it drafts from,
accepts that chain, samples one more token, and verifies next after them. :func:`engine_walk`
follows that walk, so the recorded accepted length is the engine's accepted tokens per verify
step.
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
    before = torch.cat([torch.zeros_like(region[:, :1]), region[:, :-1]], dim=1)
    starts = region & ~before
    return accepted[:, :seq][starts].sum().float(), steps[:, :seq][starts].sum().float()

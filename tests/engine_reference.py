"""What megatron's inference engine accepts when it drafts for one request at a time, by plain
loops: the reference of the single-position figures of ``+metrics``.

For each position the engine would draft from, the drafts come from megatron's own
``compute_mtp_single_step`` called exactly as the engine calls it for a batch of one request
(``[1, 1, hidden]``), depth after depth along the sequence's own tokens; the walks go position
by position as the engine goes. Used by tests/adapters and tests/distributed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "rl_drafter"


def _engine_step(model, state, token, position, depth: int):
    """megatron's ``compute_mtp_single_step`` as the engine calls it for one request, on
    tensors made under inference mode as the engine's are (Transformer Engine's norm refuses a
    normal tensor viewed inside the method's inference mode)."""
    with torch.inference_mode():
        return model.compute_mtp_single_step(
            hidden_states=state.clone(),
            next_token_ids=token.reshape(1, 1).clone(),
            position_ids=position.reshape(1, 1).clone(),
            depth=depth,
        )


def first_depth_drafts(model, hidden: torch.Tensor, ids, positions) -> torch.Tensor:
    """``[b, s]``: what the first depth drafts at each position as the engine computes it, to
    build labels it drafts right (the last position drafts nothing: 0)."""
    s, b, h = hidden.shape
    out = torch.zeros(b, s, dtype=torch.long)
    for i in range(s - 1):
        for row in range(b):
            state = hidden[i, row].reshape(1, 1, h)
            _, logits = _engine_step(model, state, ids[row, i + 1], positions[row, i + 1], 0)
            out[row, i] = logits.reshape(-1).argmax()
    return out


def per_position(
    model,
    decoder_hidden: torch.Tensor,
    ids: torch.Tensor,
    positions: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    weight: torch.Tensor,
) -> tuple[list[list[int]], list[list[list[float]]], list[list[bool]]]:
    """Per row and position: the drafts a greedy chain from there accepts, the chances that a
    sampling engine accepts at least ``n`` drafts there (``n = 0..depths``), and whether the
    engine drafts from there (the first depth has a label).

    ``decoder_hidden`` is ``[s, b, h]`` (the MTP block's input), ``weight`` the whole output
    layer; depth ``d`` at position ``i`` reads token ``ids[i + d + 1]`` and drafts for
    ``labels[i + d + 1]``, which counts where ``loss_mask`` there is not 0.
    """
    seq, batch, hidden = decoder_hidden.shape
    depths = model.config.mtp_num_layers
    policy = torch.softmax(decoder_hidden.double() @ weight.double().t(), dim=-1)  # [s, b, v]
    runs, reaches, regions = [], [], []
    for b in range(batch):
        region = [i + 1 < seq and bool(loss_mask[b, i + 1] != 0) for i in range(seq)]
        run = [0] * seq
        reach = [[1.0] + [0.0] * depths for _ in range(seq)]
        for i in range(seq):
            if not region[i]:
                continue
            state = decoder_hidden[i, b].reshape(1, 1, hidden)
            hit_so_far, product = True, 1.0
            for d in range(depths):
                j = i + d + 1
                if j >= seq or loss_mask[b, j] == 0:
                    break
                state, logits = _engine_step(model, state, ids[b, j], positions[b, j], d)
                logits = logits.reshape(-1).double()
                hit_so_far = hit_so_far and int(logits.argmax()) == int(labels[b, j])
                run[i] += int(hit_so_far)
                product *= float((torch.softmax(logits, -1) * policy[j, b]).sum())
                reach[i][d + 1] = product
        runs.append(run)
        reaches.append(reach)
        regions.append(region)
    return runs, reaches, regions


def one_request_at_a_time(*args) -> tuple[float, float]:
    """``(greedy accepted length, expected sampled accepted length)`` per verify step, the
    engine's walks over :func:`per_position`'s figures (its arguments)."""
    runs, reaches, regions = per_position(*args)
    greedy_accepted = greedy_steps = sampled_accepted = sampled_steps = 0.0
    for run, reach, region in zip(runs, reaches, regions, strict=True):
        seq = len(run)
        i = 0  # the greedy walk: verify, accept the run, go on after it
        while i < seq:
            if region[i]:
                greedy_accepted += run[i]
                greedy_steps += 1
                i += run[i] + 1
            else:
                i += 1
        accepted, steps = sampled_walk(reach, region)
        sampled_accepted += accepted
        sampled_steps += steps
    return greedy_accepted / greedy_steps, sampled_accepted / sampled_steps


def sampled_walk(reach: list[list[float]], region: list[bool]) -> tuple[float, float]:
    """A sampling engine's walk over one row, expected: ``(drafts accepted, verify steps)``.

    ``reach[i][n]`` is the chance a chain from ``i`` accepts at least ``n`` drafts. The engine
    verifies first at the row's first position in ``region``, jumps ``1 + n`` with the chance
    of accepting exactly ``n``, and where a jump lands on a position no draft starts from, it
    verifies next at the first one after (as the greedy walk of :func:`one_request_at_a_time`
    goes on)."""
    seq = len(region)
    arrive = [0.0] * (seq + len(reach[0]) + 2 if reach else seq + 1)
    arrive[0] = 1.0
    accepted = steps = 0.0
    for i in range(seq):
        if not region[i]:
            arrive[i + 1] += arrive[i]
            continue
        ahead = [*reach[i], 0.0]
        for n, chance in enumerate(a - c for a, c in zip(ahead, ahead[1:], strict=False)):
            arrive[i + n + 1] += arrive[i] * chance
        accepted += arrive[i] * sum(reach[i][1:])
        steps += arrive[i]
    return accepted, steps


def batched_against_alone(model, requests: int) -> dict:
    """``benchmarks/rl_drafter/engine_draft_attention.py``'s comparison on ``model``: each
    request's first-depth draft logits batched as the engine batches them, against alone."""
    sys.path.insert(0, str(BENCH))
    try:
        import engine_draft_attention
    finally:
        sys.path.remove(str(BENCH))
    return engine_draft_attention.compare(model, requests)

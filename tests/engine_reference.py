"""What megatron's inference engine accepts when it drafts for one request at a time, by plain
loops: the reference of the single-position figures of ``+metrics``.

For each position the engine would draft from, the drafts come from megatron's own
``compute_mtp_single_step`` called exactly as the engine calls it for a batch of one request
(``[1, 1, hidden]``), depth after depth along the sequence's own tokens; the walks go position
by position as the engine goes. Used by tests/adapters and tests/distributed.
"""

from __future__ import annotations

import torch


def one_request_at_a_time(
    model,
    decoder_hidden: torch.Tensor,
    ids: torch.Tensor,
    positions: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    weight: torch.Tensor,
) -> tuple[float, float]:
    """``(greedy accepted length, expected sampled accepted length)`` per verify step.

    ``decoder_hidden`` is ``[s, b, h]`` (the MTP block's input), ``weight`` the whole output
    layer; depth ``d`` at position ``i`` reads token ``ids[i + d + 1]`` and drafts for
    ``labels[i + d + 1]``, which counts where ``loss_mask`` there is not 0.
    """
    seq, batch, hidden = decoder_hidden.shape
    depths = model.config.mtp_num_layers
    policy = torch.softmax(decoder_hidden.double() @ weight.double().t(), dim=-1)  # [s, b, v]
    greedy_accepted = greedy_steps = sampled_accepted = sampled_steps = 0.0
    for b in range(batch):
        region = [i + 1 < seq and bool(loss_mask[b, i + 1] != 0) for i in range(seq)]
        run = [0] * seq
        reach = [[1.0] + [0.0] * depths for _ in range(seq)]  # chance of accepting >= n drafts
        for i in range(seq):
            if not region[i]:
                continue
            state = decoder_hidden[i, b].reshape(1, 1, hidden)
            hit_so_far, product = True, 1.0
            for d in range(depths):
                j = i + d + 1
                if j >= seq or loss_mask[b, j] == 0:
                    break
                state, logits = model.compute_mtp_single_step(
                    hidden_states=state,
                    next_token_ids=ids[b, j].reshape(1, 1),
                    position_ids=positions[b, j].reshape(1, 1),
                    depth=d,
                )
                logits = logits.reshape(-1).double()
                hit_so_far = hit_so_far and int(logits.argmax()) == int(labels[b, j])
                run[i] += int(hit_so_far)
                product *= float((torch.softmax(logits, -1) * policy[j, b]).sum())
                reach[i][d + 1] = product
        i = 0  # the greedy walk: verify, accept the run, go on after it
        while i < seq:
            if region[i]:
                greedy_accepted += run[i]
                greedy_steps += 1
                i += run[i] + 1
            else:
                i += 1
        visit = [0.0] * seq  # the sampling walk, expected
        for i in range(seq):
            if not region[i]:
                continue
            visit[i] += 1.0 if i == 0 or not region[i - 1] else 0.0
            ahead = [*reach[i], 0.0]
            for n, chance in enumerate(a - c for a, c in zip(ahead, ahead[1:], strict=False)):
                if i + n + 1 < seq and region[i + n + 1]:
                    visit[i + n + 1] += visit[i] * chance
            sampled_accepted += visit[i] * sum(reach[i][1:])
            sampled_steps += visit[i]
    return greedy_accepted / greedy_steps, sampled_accepted / sampled_steps

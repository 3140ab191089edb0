"""Scenarios of ``+metrics``' single-position figures under context parallelism (module-level so
``spawn`` can import them)."""

from __future__ import annotations

import torch

import mtp_hooks

from _scenarios import SEQ, VOCAB, _cp_model, _on_this_cp_rank

DEPTHS = 2


def single_position_under_cp(rank: int) -> dict:
    """CP=2: a single-position draft would run the MTP layer's attention across the ranks'
    rows, as no engine step does, so the figures are left out (``None``) while the others are
    recorded as ever."""
    model = _cp_model(depths=DEPTHS)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(SEQ).unsqueeze(0).expand(2, -1).contiguous()
    local = _on_this_cp_rank({"tokens": ids, "position_ids": positions})
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("eval=run+metrics")
    model.eval()
    with torch.no_grad():
        model(
            local["tokens"], local["position_ids"], None, labels=torch.roll(local["tokens"], -1, 1)
        )
    got = handle.metrics()["eval"]
    return {
        "local_seq": int(local["tokens"].shape[1]),
        "single": [
            got.single_position_accepted_length,
            got.single_position_sampled_accepted_length,
        ],
        "others": [got.accepted_length, got.sampled_accepted_length],
    }

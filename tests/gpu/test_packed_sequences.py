"""Packed (THD) batches through the demo models on a GPU, as veRL sends them by default: the
sequence bounds arrive on the GPU, each sequence's logits are those it gets alone, and a
training step runs or skips MTP as the policy says."""

from __future__ import annotations

import itertools

import pytest
import torch

import mtp_hooks
from mtp_hooks.demo import tiny_models

SEQ, VOCAB = 32, 128
CUTS = [0, 9, 20, SEQ]  # three sequences in one row


def kinds() -> list[str]:
    try:
        import megatron.core.models.hybrid  # noqa: F401
    except ImportError:
        return ["gpt"]
    return ["gpt", "hybrid"]


@pytest.fixture(params=kinds())
def model(request, cuda_mtp_tracker) -> torch.nn.Module:
    torch.manual_seed(0)
    spec = tiny_models.TinySpec(seq_length=SEQ, vocab_size=VOCAB)
    builder = tiny_models.build_gpt if request.param == "gpt" else tiny_models.build_hybrid
    return builder(spec, attention="sdpa").cuda()


def packed_batch():
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor(CUTS, dtype=torch.int32, device="cuda")
    longest = max(b - a for a, b in itertools.pairwise(CUTS))
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=g).cuda()
    positions = torch.cat([torch.arange(b - a) for a, b in itertools.pairwise(CUTS)])
    return params, ids, positions[None].cuda()


def test_each_packed_sequence_gets_the_logits_it_gets_alone(model):
    params, ids, positions = packed_batch()
    mtp_hooks.attach(model)
    mtp_hooks.configure("eval=skip")
    model.eval()
    with torch.no_grad():
        logits = model(ids, positions, None, packed_seq_params=params)
        for a, b in itertools.pairwise(CUTS):
            alone = model(ids[:, a:b], positions[:, a:b], None)
            torch.testing.assert_close(logits[:, a:b], alone, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("decision", ["run", "skip"])
def test_a_packed_training_step_runs_or_skips_mtp_as_the_policy_says(model, decision):
    params, ids, positions = packed_batch()
    mask = torch.ones(1, SEQ, device="cuda")
    mask[0, 2:6] = 0  # a prompt
    runs = tiny_models.MTPForwards(model)
    mtp_hooks.attach(model)
    mtp_hooks.configure(f"train={decision}")
    model.train()
    loss = model(
        ids,
        positions,
        None,
        labels=torch.roll(ids, -1, 1),
        loss_mask=mask,
        packed_seq_params=params,
    )
    loss.sum().backward()
    assert torch.isfinite(loss).all()
    assert runs.n == (1 if decision == "run" else 0)
    assert (tiny_models.recorded_mtp_loss() > 0) is (decision == "run")

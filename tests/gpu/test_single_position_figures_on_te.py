"""``+metrics``' single-position figures on Transformer Engine's layers, and what megatron's
engine feeds an MTP layer's attention there.

Skipped without CUDA or without ``transformer_engine``. The CPU tests check the figures on
megatron's local layers (tests/adapters/test_single_position_figures.py); this one runs the
same reference, megatron's ``compute_mtp_single_step`` called as the engine calls it for one
request, on TE's layers in float32.
"""

from __future__ import annotations

import pytest
import torch

import mtp_hooks
from mtp_hooks.demo import tiny_models

from engine_reference import (
    batched_against_alone,
    first_depth_drafts,
    one_request_at_a_time,
)
from model_fixtures import has_transformer_engine

pytestmark = [
    pytest.mark.skipif(
        not has_transformer_engine(), reason="needs a CUDA GPU and transformer_engine"
    ),
    pytest.mark.usefixtures("cuda_mtp_tracker"),
]

SEQ, BATCH, VOCAB, DEPTHS = 24, 2, 256, 2


def build(depths: int = DEPTHS):
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)
    spec = tiny_models.TinySpec(seq_length=SEQ, vocab_size=VOCAB, mtp_num_layers=depths)
    return tiny_models.build_gpt(spec, transformer_impl="transformer_engine").cuda().eval()


def test_the_single_position_figures_equal_the_engine_one_request_at_a_time_on_te():
    model = build()
    if not callable(getattr(model, "compute_mtp_single_step", None)):
        pytest.skip("this megatron-core has no compute_mtp_single_step (0.17 on)")
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).cuda()
    pos = torch.arange(SEQ, device="cuda").unsqueeze(0).expand(BATCH, -1)
    mask = torch.ones(BATCH, SEQ, device="cuda")
    mask[0, :6] = 0  # a prompt
    seen: list[torch.Tensor] = []
    probe = model.mtp.register_forward_hook(lambda m, a, out: seen.append(out.detach()))
    with torch.no_grad():
        model(ids, pos, None, labels=torch.roll(ids, -1, 1), loss_mask=mask)
    probe.remove()
    hidden = torch.chunk(seen[0], 1 + DEPTHS, dim=0)[0]
    labels = torch.roll(ids, -1, 1)
    labels[:, 1::2] = first_depth_drafts(model, hidden, ids, pos)[:, 0 : SEQ - 1 : 2].cuda()
    greedy, sampled = one_request_at_a_time(
        model, hidden, ids, pos, labels, mask, model.output_layer.weight.detach()
    )
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("eval=run+metrics")
    with torch.no_grad():
        model(ids, pos, None, labels=labels, loss_mask=mask)
    got = handle.metrics()["eval"]
    assert got.single_position_accepted_length == pytest.approx(greedy, rel=1e-6)
    assert got.single_position_sampled_accepted_length == pytest.approx(sampled, rel=1e-3)
    assert greedy > 0.3


def test_on_te_a_request_drafted_in_a_batch_attends_over_the_requests_before_it():
    model = build(depths=1)
    if not callable(getattr(model, "compute_mtp_single_step", None)):
        pytest.skip("this megatron-core has no compute_mtp_single_step (0.17 on)")
    result = batched_against_alone(model, requests=6)
    batched_vs_alone = result["batched_vs_alone_max_abs"]
    # Request 0 sees only itself either way: what is left is the kernels' rounding at another
    # batch shape (1.4e-4 on an H200). Every later request also attends over the others.
    assert batched_vs_alone[0] < 1e-3
    assert all(d > 20 * batched_vs_alone[0] for d in batched_vs_alone[1:])

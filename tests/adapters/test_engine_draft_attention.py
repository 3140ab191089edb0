"""What megatron-core's engine feeds an MTP layer's attention when it drafts, shown on megatron's
own local layers: the claim behind the single-position figures' documentation.

The engine stacks its active requests as one sequence (``[requests, 1, hidden]``) and calls
``compute_mtp_single_step`` with no mask; the layer's causal mask then lets request ``r``
attend over requests ``0..r``. If a megatron-core release changes that, this test fails and
the docs (user guide, benchmarks) must follow.
"""

from __future__ import annotations

import pytest
import torch

from mtp_hooks.demo import tiny_models

from cpu_stand_ins import cpu_causal_mask
from engine_reference import batched_against_alone


def test_a_request_drafted_in_a_batch_attends_over_the_requests_before_it(monkeypatch):
    torch.manual_seed(0)
    model = tiny_models.build_gpt(tiny_models.TinySpec(mtp_num_layers=1)).eval()
    if not callable(getattr(model, "compute_mtp_single_step", None)):
        pytest.skip("this megatron-core has no compute_mtp_single_step (0.17 on)")
    from megatron.core.fusions import fused_softmax

    # megatron builds the default causal mask on CUDA
    monkeypatch.setattr(fused_softmax, "get_default_causal_mask", cpu_causal_mask)
    result = batched_against_alone(model, requests=6)
    batched_vs_alone = result["batched_vs_alone_max_abs"]
    moved = result["after_changing_request_0_max_abs"]
    assert batched_vs_alone[0] < 1e-5  # the first request sees only itself
    assert all(d > 1e-3 for d in batched_vs_alone[1:])  # every later one sees the others
    assert moved[0] > 1e-2 and all(d > 1e-4 for d in moved[1:])  # request 0 moves them all

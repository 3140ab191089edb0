"""A frozen MoE MTP layer (DeepSeek-V3 style) stays bit-identical, its router's expert bias too.

The steps are real: megatron's ``DistributedDataParallel`` and ``finalize_model_grads``, which
moves every training-mode router's ``expert_bias``. Megatron allocates the router buffers and
DDP's streams through ``torch.cuda``; on a CPU the fixture points those two calls at the CPU.
"""

from __future__ import annotations

import pytest
import torch

import mtp_hooks
from mtp_hooks.demo import tiny_models

from model_fixtures import SEQ, VOCAB, megatron_ddp_steps


@pytest.fixture
def cuda_on_cpu(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: None)


def build_moe_gpt(seed: int = 0) -> torch.nn.Module:
    """A GPTModel whose decoder layers and MTP layer are MoE with expert-bias routing."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )

    torch.manual_seed(seed)
    spec = tiny_models.TinySpec(seq_length=SEQ, vocab_size=VOCAB, bias=False)
    config = tiny_models._config(
        spec,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_router_enable_expert_bias=True,
        moe_router_score_function="sigmoid",
        moe_router_load_balancing_type="none",
        moe_token_dispatcher_type="allgather",
        moe_router_bias_update_rate=1e-2,
    )
    layer_spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="learned_absolute",
        mtp_block_spec=get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=False),
    )


def snapshot(model: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    return {k: v.clone() for k, v in state.items() if k.startswith(prefix) and torch.is_tensor(v)}


def routers_have_the_flag(model: torch.nn.Module) -> bool:
    routers = [m for m in model.mtp.modules() if getattr(m, "expert_bias", None) is not None]
    assert routers
    return all(hasattr(r, "frozen_expert_bias") for r in routers)


def moe_forward_runs_without_te() -> bool:
    """megatron-core 0.16.1's router GEMM names te_general_gemm even without transformer-engine."""
    from megatron.core.transformer.moe import moe_utils

    return hasattr(moe_utils, "te_general_gemm")


pytestmark = pytest.mark.usefixtures("cuda_on_cpu")
needs_moe_forward = pytest.mark.skipif(
    not moe_forward_runs_without_te(),
    reason="this megatron-core's MoE router forward needs transformer-engine",
)


def test_a_frozen_moe_mtp_layer_and_its_expert_bias_stay_bit_identical(batch):
    model = build_moe_gpt()
    if not routers_have_the_flag(model):
        pytest.skip("this megatron-core's router has no frozen_expert_bias")
    frozen = mtp_hooks.megatron.freeze_mtp(model)
    assert any("router" in name for name in frozen)
    mtp_before, trunk_before = snapshot(model, "mtp."), snapshot(model, "decoder.")
    assert any(k.endswith("expert_bias") for k in mtp_before)
    mtp_hooks.configure("train=run")
    megatron_ddp_steps(model, batch, steps=3)
    mtp_after, trunk_after = snapshot(model, "mtp."), snapshot(model, "decoder.")
    assert all(torch.equal(mtp_before[k], mtp_after[k]) for k in mtp_before)
    moved = [k for k in trunk_before if not torch.equal(trunk_before[k], trunk_after[k])]
    assert any(k.endswith("expert_bias") for k in moved)
    assert any(k.endswith("weight") for k in moved)


@needs_moe_forward
def test_without_freezing_the_mtp_expert_bias_moves(batch):
    model = build_moe_gpt()
    before = snapshot(model, "mtp.")
    mtp_hooks.configure("train=run")
    megatron_ddp_steps(model, batch, steps=3)
    after = snapshot(model, "mtp.")
    bias = [k for k in before if k.endswith("expert_bias")]
    assert bias and any(not torch.equal(before[k], after[k]) for k in bias)


@needs_moe_forward
def test_a_skipped_mtp_router_keeps_its_expert_bias(batch):
    model = build_moe_gpt()
    before = snapshot(model, "mtp.")
    mtp_hooks.configure("train=skip")
    megatron_ddp_steps(model, batch, steps=3)
    after = snapshot(model, "mtp.")
    bias = [k for k in before if k.endswith("expert_bias")]
    assert bias and all(torch.equal(before[k], after[k]) for k in bias)


def test_freezing_an_moe_mtp_layer_is_refused_without_the_router_flag():
    model = build_moe_gpt()
    if routers_have_the_flag(model):
        pytest.skip("this megatron-core's router has frozen_expert_bias")
    with pytest.raises(mtp_hooks.UnsupportedModelError, match="frozen_expert_bias"):
        mtp_hooks.megatron.freeze_mtp(model)
    assert all(p.requires_grad for p in model.mtp.parameters())

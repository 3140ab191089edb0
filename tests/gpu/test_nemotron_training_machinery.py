"""The Nemotron-3-shaped hybrid through megatron's training machinery, on one GPU: local and
Transformer Engine CUDA graphs, full activation recompute, and megatron's distributed
checkpoint of the MTP weights.

The model is tests/gpu/nemotron_on_gpu.py's. Skipped without CUDA, Transformer Engine or
mamba-ssm. Forward results are compared bit for bit; gradients against the run-to-run spread
of the same computation, because the Mamba layers' backward kernels add atomically.
"""

from __future__ import annotations

import pytest
import torch

import mtp_hooks

from model_fixtures import has_detach_field
from nemotron_on_gpu import (
    BATCH,
    MARKS,
    SEQ,
    batch,
    build,
    grads_of,
    trunk,
    trunk_twin,
    within_spread,
)

pytestmark = MARKS

GRAPHED = ["attn", "mamba"]  # MoE layers are graphed only with drop-and-pad routing
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def unhooked_twin(model, **kwargs):
    """The same model, every weight included, built again and never attached."""
    twin = build(**kwargs)
    missing, unexpected = twin.load_state_dict(model.state_dict(), strict=False)
    assert [k for k in missing if not k.endswith("_extra_state")] == [] and unexpected == []
    return twin


def mtp_forwards(model) -> list[bool]:
    """A list that grows by one (``torch.is_grad_enabled()``) at each forward of the MTP block."""
    runs: list[bool] = []
    model.mtp.register_forward_hook(lambda *_: runs.append(torch.is_grad_enabled()))
    return runs


def eval_logits(model, data) -> torch.Tensor:
    ids, pos, _ = data
    model.eval()
    with torch.no_grad():
        return model(ids, pos, None)


def eval_losses(model, data) -> torch.Tensor:
    """The per-token language-model loss of a ``no_grad`` evaluation forward (given labels,
    megatron runs the MTP block there too)."""
    ids, pos, labels = data
    model.eval()
    with torch.no_grad():
        return model(ids, pos, None, labels=labels)


# -- local CUDA graphs ---------------------------------------------------------------------------


def local_graphs(seed: int):
    model = build(seed=seed, cuda_graph_impl="local", cuda_graph_modules=GRAPHED)
    assert any(hasattr(m, "cudagraph_manager") for m in model.modules())
    return model


def test_under_local_graphs_training_runs_mtp_and_evaluation_skips_it_with_megatrons_losses():
    model = local_graphs(seed=20)
    megatron = local_graphs(seed=20)  # the same weights, never attached
    mtp_hooks.configure("train=run,eval=skip")
    mtp_hooks.attach(model)
    ran, ran_unhooked = mtp_forwards(model), mtp_forwards(megatron)
    data = batch()
    # past megatron's warm-up steps, so that the later forwards replay recorded graphs
    for step in range(model.config.cuda_graph_warmup_steps + 2):
        loss, _ = grads_of(model, data)
        unhooked_loss, _ = grads_of(megatron, data)
        assert torch.equal(loss, unhooked_loss), step
    assert ran == ran_unhooked and all(ran)
    assert torch.equal(eval_losses(model, data), eval_losses(megatron, data))
    assert len(ran) == len(ran_unhooked) - 1  # megatron ran MTP in evaluation too; we did not


@pytest.mark.skipif(not has_detach_field(), reason="+detach needs mtp_detach_heads (0.19 on)")
def test_detach_is_refused_under_live_local_graphs_and_holds_once_they_are_toggled_off():
    from megatron.core.transformer.utils import toggle_cuda_graphs

    model = local_graphs(seed=21)
    mtp_hooks.megatron.clip_mtp_apart(model)
    mtp_hooks.configure("train=run+detach,eval=skip")
    with pytest.raises(mtp_hooks.UnsupportedModelError, match="CUDA graphs"):
        mtp_hooks.attach(model)
    assert not model._forward_pre_hooks
    # what Megatron-LM's RL loop does before its log-prob and training passes
    toggle_cuda_graphs(model, "none")
    model.config.cuda_graph_impl = "local"
    handle = mtp_hooks.attach(model)
    data = batch()
    _, detached = grads_of(model, data)
    mtp_hooks.configure("train=skip")
    _, skipped = grads_of(model, data)
    _, skipped_again = grads_of(model, data)
    spread = within_spread("graphs off", trunk(detached), trunk(skipped), trunk(skipped_again))
    assert spread == []
    assert all(g is not None for n, g in detached.items() if n.startswith("mtp."))
    assert handle.stats()["train"] == {"run": 1, "detached": 1, "skip": 2}


# -- Transformer Engine CUDA graphs ---------------------------------------------------------------


def te_graphed(seed: int):
    """The model in megatron's DDP with its attention and Mamba layers captured by Transformer
    Engine before the first step, as megatron's training loop captures them."""
    from megatron.core import num_microbatches_calculator as num_microbatches
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.cuda_graphs import TECudaGraphHelper

    model = build(seed=seed, cuda_graph_impl="transformer_engine", cuda_graph_modules=GRAPHED)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    num_microbatches.unset_num_microbatches_calculator()  # the helper counts microbatches
    num_microbatches.init_num_microbatches_calculator(0, None, BATCH, BATCH, 1)
    helper = TECudaGraphHelper([ddp], model.config, SEQ, BATCH)
    helper.create_cudagraphs()
    graphed = [m for m in model.modules() if getattr(m, "cuda_graphs", None)]
    assert graphed, "Transformer Engine captured no layer"
    return ddp, model


def ddp_step(ddp, data) -> tuple[torch.Tensor, dict]:
    """One training step's forward and backward through megatron's DDP: the loss, and each MTP
    weight's gradient as DDP's buffer holds it."""
    ids, pos, labels = data
    ddp.zero_grad_buffer()
    ddp.train()
    loss = ddp(ids, pos, None, labels=labels)
    loss.float().sum().backward()
    ddp.finish_grad_sync()
    mtp = {n: p.main_grad.detach().clone() for n, p in ddp.module.mtp.named_parameters()}
    return loss.detach(), mtp


@pytest.mark.parametrize("policy", ["train=run,eval=skip", "train=skip,eval=skip"])
def test_under_te_graphs_the_policy_decides_and_evaluation_keeps_megatrons_losses(policy):
    ddp, model = te_graphed(seed=22)
    megatron_ddp, megatron = te_graphed(seed=22)
    mtp_hooks.configure(policy)
    mtp_hooks.attach(ddp)
    ran, ran_unhooked = mtp_forwards(model), mtp_forwards(megatron)
    data = batch()
    runs = policy.startswith("train=run")
    for step in range(2):
        loss, mtp_grads = ddp_step(ddp, data)
        unhooked_loss, _ = ddp_step(megatron_ddp, data)
        assert torch.isfinite(loss.float()).all()
        if runs:
            assert torch.equal(loss, unhooked_loss), step
        trained = [n for n, g in mtp_grads.items() if bool(g.abs().sum() > 0)]
        assert bool(trained) is runs, (step, trained[:3])
    assert ran == ([True, True] if runs else [])
    assert torch.equal(eval_losses(ddp, data), eval_losses(megatron_ddp, data))
    assert len(ran_unhooked) == 3  # megatron's own: both training steps and the evaluation


# -- activation recompute -----------------------------------------------------------------------


def test_under_full_recompute_run_is_megatrons_and_skip_the_trunks():
    model = build(seed=23, **RECOMPUTE)
    megatron, plain = unhooked_twin(model, **RECOMPUTE), trunk_twin(model, **RECOMPUTE)
    data = batch()
    megatron_loss, megatron_grads = grads_of(megatron, data)
    _, megatron_again = grads_of(megatron, data)
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=run")
    loss, grads = grads_of(model, data)
    assert torch.equal(loss, megatron_loss)
    assert within_spread("recompute run", grads, megatron_grads, megatron_again) == []
    mtp_hooks.configure("train=skip")
    loss, grads = grads_of(model, data)
    plain_loss, reference = grads_of(plain, data)
    _, again = grads_of(plain, data)
    assert torch.equal(loss, plain_loss)
    assert all(g is None for n, g in grads.items() if n.startswith("mtp."))
    assert within_spread("recompute skip", trunk(grads), reference, again) == []


def test_recompute_changes_no_forward_bit_under_run_or_skip():
    recomputed = build(seed=24, **RECOMPUTE)
    eager = unhooked_twin(recomputed)
    mtp_hooks.attach(recomputed)
    mtp_hooks.attach(eager)
    data = batch()
    for policy in ("train=run", "train=skip"):
        mtp_hooks.configure(policy)
        assert torch.equal(grads_of(recomputed, data)[0], grads_of(eager, data)[0]), policy


# -- megatron's distributed checkpoint ------------------------------------------------------------


def test_frozen_mtp_weights_come_back_bit_for_bit_from_megatrons_distributed_checkpoint(tmp_path):
    from megatron.core import dist_checkpointing

    model = build(seed=25)
    mtp_hooks.megatron.freeze_mtp(model)
    before = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=run")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for step in range(2):
        grads_of(model, batch(seed=step))
        optimizer.step()
    trained = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    mtp_keys = [k for k in trained if k.startswith("mtp.") and not k.endswith("_extra_state")]
    assert len(mtp_keys) > 30
    assert [k for k in mtp_keys if not torch.equal(trained[k], before[k])] == []
    assert any(not torch.equal(trained[k], before[k]) for k in trained if k not in mtp_keys)

    dist_checkpointing.save(model.sharded_state_dict(), str(tmp_path))
    fresh = build(seed=26)
    assert any(not torch.equal(fresh.state_dict()[k], before[k]) for k in mtp_keys)
    loaded = dist_checkpointing.load(fresh.sharded_state_dict(), str(tmp_path))
    missing, unexpected = fresh.load_state_dict(loaded, strict=False)
    assert [k for k in missing if not k.endswith("_extra_state")] == [] and unexpected == []
    restored = fresh.state_dict()
    assert [k for k in mtp_keys if not torch.equal(restored[k], before[k])] == []
    weights = [k for k in trained if k.endswith("weight")]
    assert [k for k in weights if not torch.equal(restored[k], trained[k])] == []
    mtp_hooks.attach(fresh)
    mtp_hooks.configure("eval=skip")
    data = batch()
    assert torch.equal(eval_logits(fresh, data), eval_logits(model, data))

"""Every library path on a Nemotron-3-shaped ``HybridModel``: a trunk of Mamba-2, MoE and
attention layers (a sigmoid router with expert bias), and two attention + MoE MTP depths.

On a CPU, megatron's Mamba-2 layer runs mamba-ssm's Triton kernels through Triton's interpreter
(tests/mamba_on_cpu.py), so a step takes seconds: the model is as small as megatron allows. The
trunk built without MTP (pattern ``ME*E``) is the reference wherever the arithmetic is the same,
and every comparison there is bit for bit: these kernels, run twice on a CPU, give the same bits
(checked by the first test).
"""

from __future__ import annotations

import pytest
import torch

import mtp_hooks
from mtp_hooks.demo import nemotron_models, tiny_models
from mtp_hooks_drafting import AcceptanceController

from model_fixtures import (
    has_detach_field,
    has_hybrid,
    megatron_ddp_steps,
    nemotron_spec,
    train_step,
)

pytestmark = [
    pytest.mark.skipif(not has_hybrid(), reason="HybridModel needs megatron-core 0.18+"),
    pytest.mark.usefixtures("mamba_cpu", "mtp_tracker_two_depths"),
]

TRUNK = nemotron_models.NEMOTRON_PATTERN.split("/")[0]
DEPTHS = nemotron_models.NEMOTRON_PATTERN.count("/")


@pytest.fixture
def mtp_tracker_two_depths(mamba_cpu):
    tiny_models.reset_mtp_loss_tracker(num_layers=DEPTHS)


def nemotron(seed: int = 0, **kwargs) -> torch.nn.Module:
    torch.manual_seed(seed)
    return nemotron_models.build_nemotron(nemotron_spec(), attention="sdpa", **kwargs)


def trunk_twin(model: torch.nn.Module, **kwargs) -> torch.nn.Module:
    """The same trunk built without MTP, holding ``model``'s trunk weights and router state."""
    plain = nemotron(pattern=TRUNK, **kwargs)
    trunk = {k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")}
    missing, unexpected = plain.load_state_dict(trunk, strict=False)
    assert [k for k in missing if not k.endswith("_extra_state")] == [] and unexpected == []
    return plain


def twin(model: torch.nn.Module, **kwargs) -> torch.nn.Module:
    """A second model with MTP holding ``model``'s every weight and buffer."""
    other = nemotron(**kwargs)
    other.load_state_dict(model.state_dict())
    return other


def trunk_grads(grads: dict) -> dict:
    return {n: g for n, g in grads.items() if not n.startswith("mtp.")}


def bitwise(a: dict, b: dict) -> list[str]:
    """Names whose tensors differ (None must meet None)."""
    assert a.keys() == b.keys()
    return [
        n
        for n in a
        if (a[n] is None) != (b[n] is None) or (a[n] is not None and not torch.equal(a[n], b[n]))
    ]


def eval_logits(model, batch) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(*batch.args())


def test_the_model_has_the_nemotron_3_layers_and_its_kernels_repeat_bit_for_bit(batch):
    model = nemotron()
    kinds = [type(layer).__name__ for layer in model.decoder.layers]
    assert kinds == ["MambaLayer", "MoETransformerLayer", "TransformerLayer", "MoETransformerLayer"]
    assert len(model.mtp.layers) == DEPTHS
    routers = [m for m in model.modules() if getattr(m, "expert_bias", None) is not None]
    assert len(routers) == 2 + DEPTHS  # the trunk's two MoE layers and one per depth
    first, second = train_step(model, batch), train_step(model, batch)
    assert torch.equal(first[0], second[0]) and bitwise(first[1], second[1]) == []


def test_a_skip_gives_the_logits_and_gradients_of_the_trunk_built_without_mtp(batch, count_mtp):
    model = nemotron(seed=1)
    plain = trunk_twin(model)
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip,eval=skip,rollout=skip")
    ran = count_mtp(model)
    assert torch.equal(eval_logits(model, batch), eval_logits(plain, batch))
    loss, grads = train_step(model, batch)
    plain_loss, plain_grads = train_step(plain, batch)
    assert torch.equal(loss, plain_loss)
    assert bitwise(trunk_grads(grads), plain_grads) == []
    assert all(g is None for n, g in grads.items() if n.startswith("mtp."))
    assert ran.n == 0 and tiny_models.recorded_mtp_loss() == 0


def test_run_trains_every_depth_and_a_weight_replaces_the_configured_one(batch, count_mtp):
    model = nemotron(seed=2)
    weighted = twin(model)
    mtp_hooks.attach(model)
    mtp_hooks.attach(weighted)
    mtp_hooks.configure("train=run")
    ran = count_mtp(model)
    _, grads = train_step(model, batch)
    assert ran.n == 1 and tiny_models.recorded_mtp_loss() > 0
    mtp = {n: g for n, g in grads.items() if n.startswith("mtp.")}
    assert mtp and all(g is not None for g in mtp.values())
    mtp_hooks.configure("train=run:0.5")  # in place of the model's mtp_loss_scaling_factor
    _, half = train_step(weighted, batch)
    ratio = 0.5 / model.config.mtp_loss_scaling_factor
    for name, grad in mtp.items():
        torch.testing.assert_close(half[name], ratio * grad, rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(not has_detach_field(), reason="+detach needs mtp_detach_heads (0.19 on)")
def test_detach_trains_mtp_and_leaves_the_trunk_gradients_those_of_a_skip(batch):
    model = nemotron(seed=3)
    skipped = twin(model)
    mtp_hooks.megatron.clip_mtp_apart(model)
    mtp_hooks.attach(model)
    mtp_hooks.attach(skipped, role="reference")
    mtp_hooks.configure("train=run+detach,reference.train=skip")
    _, grads = train_step(model, batch)
    _, skip_grads = train_step(skipped, batch)
    assert bitwise(trunk_grads(grads), trunk_grads(skip_grads)) == []
    assert all(g is not None and g.abs().sum() > 0 for n, g in grads.items() if "mtp." in n[:4])


@pytest.mark.skipif(not has_detach_field(), reason="+objective needs +detach (0.19 on)")
@pytest.mark.parametrize("objective", ["kl", "tv"])
def test_an_objective_trains_the_drafter_on_the_policy_and_leaves_the_trunk_alone(batch, objective):
    model = nemotron(seed=4)
    ce = twin(model)
    for m in (model, ce):
        mtp_hooks.megatron.clip_mtp_apart(m)
    mtp_hooks.attach(model)
    mtp_hooks.attach(ce, role="reference")
    mtp_hooks.configure(f"train=run+detach+objective:{objective},reference.train=run+detach")
    _, toward_policy = train_step(model, batch)
    _, plain = train_step(ce, batch)
    assert bitwise(trunk_grads(toward_policy), trunk_grads(plain)) == []
    depth_weights = [n for n, g in toward_policy.items() if n.startswith("mtp.") and g is not None]
    assert depth_weights
    assert any(not torch.equal(toward_policy[n], plain[n]) for n in depth_weights)


def test_mask_labels_trains_mtp_as_the_hand_built_mask_does(batch):
    labels = batch.labels.clone()
    labels[:, :5] = -100  # a prompt
    model = nemotron(seed=5)
    plain = twin(model)
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("train=run+mask:labels")
    model.train()
    model(*batch.args(), labels=labels).sum().backward()
    plain.train()
    plain(*batch.args(), labels=labels, loss_mask=(labels != -100).float()).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert bitwise(grads, {n: p.grad for n, p in plain.named_parameters()}) == []
    assert handle.stats()["train"] == {"run": 1, "masked": 1}


def test_metrics_record_every_depth_and_the_single_position_figures_moving_no_router(batch):
    model = nemotron(seed=6)
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("eval=run+metrics")
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    model.eval()
    with torch.no_grad():
        model(*batch.args(), labels=batch.labels)
    figures = handle.metrics()["eval"]
    assert len(figures.loss) == DEPTHS and all(loss > 0 for loss in figures.loss)
    assert figures.accepted_length is not None
    if callable(getattr(model, "compute_mtp_single_step", None)):  # megatron's engine drafts so
        assert figures.single_position_accepted_length is not None
    assert bitwise(buffers, dict(model.named_buffers())) == []
    controller = AcceptanceController(
        target=10.0, below=0.3, above=None, metric="single_position_accepted_length"
    )
    if figures.single_position_accepted_length is not None:
        assert controller.update(figures) == 0.3  # a random drafter is below any target
        assert controller.value == pytest.approx(figures.single_position_accepted_length)


def test_freezing_the_mtp_block_keeps_its_weights_and_expert_bias_over_steps(batch, monkeypatch):
    model = nemotron(seed=7)
    if not all(
        hasattr(r, "frozen_expert_bias")
        for r in model.mtp.modules()
        if getattr(r, "expert_bias", None) is not None
    ):
        pytest.skip("this megatron-core's router has no frozen_expert_bias")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: None)  # DDP's streams
    mtp_hooks.megatron.freeze_mtp(model)
    before = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    mtp_hooks.configure("train=run,eval=skip")
    megatron_ddp_steps(model, batch, steps=2, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    after = model.state_dict()
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert not [k for k in moved if k.startswith("mtp.")]
    assert any(k.startswith("decoder.") and k.endswith("expert_bias") for k in moved)
    assert any(k.startswith("decoder.") and "mixer" in k for k in moved)  # Mamba trains


def test_freezing_the_trunk_trains_only_the_mtp_block_or_is_refused_changing_nothing(batch):
    model = nemotron(seed=8)
    routers = [m for m in model.decoder.modules() if getattr(m, "expert_bias", None) is not None]
    if not all(hasattr(r, "frozen_expert_bias") for r in routers):  # before 0.19
        with pytest.raises(mtp_hooks.UnsupportedModelError, match="frozen_expert_bias"):
            mtp_hooks.megatron.freeze_trunk(model)
        assert all(p.requires_grad for p in model.parameters())
        return
    frozen = mtp_hooks.megatron.freeze_trunk(model)
    assert any("mixer" in name for name in frozen)
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=run")
    _, grads = train_step(model, batch)
    assert all(g is None for g in trunk_grads(grads).values())
    assert all(g is not None for n, g in grads.items() if n.startswith("mtp."))


def test_under_full_activation_recompute_run_is_megatrons_and_skip_the_trunks(batch, monkeypatch):
    if not torch.cuda.is_available():  # megatron's checkpoint saves the CUDA generator's state
        monkeypatch.setattr(torch.cuda.random, "get_rng_state", lambda *a, **k: torch.empty(0))
    recompute = dict(recompute_granularity="full", recompute_method="uniform")
    recompute["recompute_num_layers"] = 1
    model = nemotron(seed=9, **recompute)
    unhooked, plain = twin(model, **recompute), trunk_twin(model, **recompute)
    try:
        megatron_loss, megatron_grads = train_step(unhooked, batch)
    except TypeError as exc:  # 0.18.2 hands its MTP layer's recompute a padding_mask it refuses
        pytest.skip(f"megatron-core's own full recompute of the MTP layers fails: {exc}")
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=run")
    loss, grads = train_step(model, batch)
    assert torch.equal(loss, megatron_loss) and bitwise(grads, megatron_grads) == []
    mtp_hooks.configure("train=skip")
    loss, grads = train_step(model, batch)
    trunk_loss, trunk = train_step(plain, batch)
    assert torch.equal(loss, trunk_loss) and bitwise(trunk_grads(grads), trunk) == []


def test_one_repeated_mtp_layer_serves_both_depths_and_skips_like_the_trunk(batch, count_mtp):
    model = nemotron(seed=10, repeated_mtp=True)
    assert len(model.mtp.layers) == 1 and model.config.mtp_num_layers == DEPTHS
    plain = trunk_twin(model)
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=run,eval=skip")
    ran = count_mtp(model)
    train_step(model, batch)
    assert ran.n == 1 and tiny_models.recorded_mtp_loss() > 0
    assert torch.equal(eval_logits(model, batch), eval_logits(plain, batch))


def test_a_skip_on_a_tied_mtp_stage_is_refused_at_attach_naming_the_fixes():
    torch.manual_seed(0)
    model = nemotron_models.build_nemotron(
        nemotron_spec(), attention="sdpa", pre_process=False, share_embeddings=True
    )
    assert model.mtp_process and not model.pre_process
    config = model.config
    mtp_hooks.configure("train=run,eval=skip")
    with pytest.raises(mtp_hooks.UnsupportedModelError, match=r"eval=skip.*tied|eval=skip") as err:
        mtp_hooks.attach(model)
    assert "share_embeddings_and_output_weights=False" in str(err.value)
    assert "compute_mtp_loss" in str(err.value)
    assert model.mtp_process is True and model.config is config
    assert not model._forward_pre_hooks and not model._forward_hooks

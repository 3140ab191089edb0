"""Skips under data parallelism give MTP zero gradients; freeze_mtp takes MTP out entirely.

Megatron DDP needs CUDA (see tests/gpu); torch DDP on one gloo rank shows the same contract:
every parameter that requires grad must get one in every iteration.
"""

from __future__ import annotations

import pytest
import torch

import mtp_hooks
from mtp_hooks.demo import tiny_models


def ddp(model, **kwargs):
    return torch.nn.parallel.DistributedDataParallel(model, **kwargs)


def naive_skip(model):
    """What a framework does by hand today: flip the gates, no zero gradients."""
    import copy

    model.mtp_process = False
    model.config = copy.copy(model.config)
    model.config.mtp_num_layers = None


def test_an_unremedied_skip_breaks_torch_ddp(build, batch):
    model = build()
    naive_skip(model)
    wrapped = ddp(model)
    wrapped(*batch.args(), labels=batch.labels).sum().backward()
    with pytest.raises(RuntimeError, match="(?i)finished reduction|unused parameters"):
        wrapped(*batch.args(), labels=batch.labels).sum().backward()


def test_skips_under_ddp_give_every_mtp_parameter_a_zero_gradient(build, batch):
    model = build()
    wrapped = ddp(model)
    mtp_hooks.attach(wrapped)
    mtp_hooks.configure("train=skip")
    for _ in range(3):  # DDP would raise on the second iteration without the zero gradients
        wrapped(*batch.args(), labels=batch.labels).sum().backward()
    mtp = {n: p.grad for n, p in model.named_parameters() if n.startswith("mtp.")}
    assert mtp and all(g is not None and not g.any() for g in mtp.values())


def test_the_zero_gradient_leaves_the_output_viewless_and_the_loss_unchanged(build, batch):
    reference, model = build(seed=4), build(seed=4)
    wrapped = ddp(model)
    mtp_hooks.attach(wrapped)
    mtp_hooks.configure("train=skip")
    out = wrapped(*batch.args(), labels=batch.labels)
    assert out._base is None  # pipeline schedules assert this
    ref_out = reference(*batch.args(), labels=batch.labels)
    assert torch.equal(out, ref_out)


def test_alternating_run_and_skip_under_ddp_keeps_working(build, batch, count_mtp):
    model = build()
    counter = count_mtp(model)
    wrapped = ddp(model)
    mtp_hooks.attach(wrapped)
    for policy in ("train=run", "train=skip", "train=run", "train=skip"):
        mtp_hooks.configure(policy)
        wrapped(*batch.args(), labels=batch.labels).sum().backward()
    assert counter.n == 2


def test_freeze_mtp_turns_off_requires_grad_on_exactly_the_mtp_parameters(build):
    model = build()
    frozen = mtp_hooks.megatron.freeze_mtp(model)
    names = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert names == set(frozen) == {n for n, _ in model.named_parameters() if n.startswith("mtp.")}


def test_freeze_mtp_on_a_stage_without_pre_process_also_freezes_the_embedding_copy(build):
    model = build(pre_process=False)
    frozen = set(mtp_hooks.megatron.freeze_mtp(model))
    assert "embedding.word_embeddings.weight" in frozen
    assert any(n.startswith("mtp.") for n in frozen)


def test_freeze_mtp_on_a_wrapped_model_is_refused_and_changes_nothing(build):
    model = build()
    wrapped = ddp(model)
    with pytest.raises(mtp_hooks.UnsupportedModelError, match="before the model is wrapped in DDP"):
        mtp_hooks.megatron.freeze_mtp(wrapped)
    assert all(p.requires_grad for p in model.parameters())


def test_frozen_mtp_gets_no_zero_gradient_trick(build, batch):
    model = build()
    mtp_hooks.megatron.freeze_mtp(model)
    wrapped = ddp(model)
    mtp_hooks.attach(wrapped)
    mtp_hooks.configure("train=skip")
    for _ in range(2):
        wrapped(*batch.args(), labels=batch.labels).sum().backward()
    assert all(p.grad is None for n, p in model.named_parameters() if n.startswith("mtp."))


def moved_by_adamw_steps(model, batch, policy: str, steps: int = 3) -> set[str]:
    """Train ``model`` (frozen parts already frozen) under torch DDP and AdamW with weight
    decay for ``steps`` steps under ``policy``; the names of the parameters that moved."""
    wrapped = ddp(model)
    mtp_hooks.attach(wrapped)
    mtp_hooks.configure(policy)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1
    )
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        wrapped(*batch.args(), labels=batch.labels).sum().backward()
        optimizer.step()
    return {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}


def test_frozen_mtp_weights_stay_bit_identical_across_optimizer_steps(build, batch):
    model = build()
    mtp_hooks.megatron.freeze_mtp(model)
    changed = moved_by_adamw_steps(model, batch, "train=skip")
    assert changed and not any(n.startswith("mtp.") for n in changed)


def test_zero_gradients_still_move_mtp_weights_under_adamw_weight_decay(build, batch):
    model = build()
    wrapped = ddp(model)
    mtp_hooks.attach(wrapped)
    mtp_hooks.configure("train=skip")
    before = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("mtp.")}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    wrapped(*batch.args(), labels=batch.labels).sum().backward()
    optimizer.step()
    moved = [
        n for n, p in model.named_parameters() if n in before and not torch.equal(p, before[n])
    ]
    assert moved  # why docs/distributed.md recommends freeze_mtp for truly frozen weights


def test_a_skip_on_a_bare_model_inside_megatron_ddp_is_refused_with_the_fix(build, batch):
    model = build()
    for p in model.parameters():  # what Megatron DDP does to every parameter it buffers
        p.main_grad = torch.zeros_like(p)
    mtp_process, config = model.mtp_process, model.config
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip")
    with pytest.raises(mtp_hooks.UnsupportedModelError, match=r"mtp_hooks.attach\(ddp_model\)"):
        model(*batch.args(), labels=batch.labels)
    assert model.mtp_process is mtp_process and model.config is config


def test_freeze_trunk_leaves_exactly_the_mtp_parameters_trainable(build):
    model = build()
    frozen = set(mtp_hooks.megatron.freeze_trunk(model))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in model.named_parameters() if n.startswith("mtp.")}
    assert frozen == {n for n, _ in model.named_parameters()} - trainable


def test_with_a_frozen_trunk_mtp_trains_and_the_trunk_stays_bit_identical(build, batch):
    model = build()
    mtp_hooks.megatron.freeze_trunk(model)
    moved = moved_by_adamw_steps(model, batch, "train=run")
    assert moved == {n for n, _ in model.named_parameters() if n.startswith("mtp.")}


def test_freeze_trunk_on_a_wrapped_model_or_one_without_mtp_is_refused_and_changes_nothing(
    build,
):
    model = build()
    with pytest.raises(mtp_hooks.UnsupportedModelError, match="before the model is wrapped"):
        mtp_hooks.megatron.freeze_trunk(ddp(model))
    plain = build(spec=tiny_models.TinySpec(seq_length=16, vocab_size=128, mtp_num_layers=None))
    with pytest.raises(mtp_hooks.UnsupportedModelError, match="has no MTP block"):
        mtp_hooks.megatron.freeze_trunk(plain)
    assert all(p.requires_grad for m in (model, plain) for p in m.parameters())

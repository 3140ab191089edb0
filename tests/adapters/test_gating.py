"""A decision becomes a real run or skip of the MTP forward and loss, on real models."""

from __future__ import annotations

import pytest
import torch

import mtp_hooks
from mtp_hooks.demo import tiny_models


def grads(model) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def train_step(model, batch):
    loss = model(*batch.args(), labels=batch.labels)
    loss.sum().backward()
    return loss.detach()


def test_a_run_decision_is_bit_identical_to_no_hooks(build, batch):
    plain, hooked = build(seed=3), build(seed=3)
    mtp_hooks.attach(hooked)
    mtp_hooks.configure("train=run")
    loss_plain = train_step(plain, batch)
    mtp_plain = tiny_models.recorded_mtp_loss()
    tiny_models.reset_mtp_loss_tracker()
    loss_hooked = train_step(hooked, batch)
    assert torch.equal(loss_plain, loss_hooked)
    assert tiny_models.recorded_mtp_loss() == mtp_plain > 0
    g_plain, g_hooked = grads(plain), grads(hooked)
    assert g_plain.keys() == g_hooked.keys()
    for name in g_plain:
        assert torch.equal(g_plain[name], g_hooked[name]), name


def test_a_skip_decision_does_not_run_the_mtp_block(build, batch, count_mtp):
    model = build()
    counter = count_mtp(model)
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip")
    train_step(model, batch)
    assert counter.n == 0


def test_a_skip_decision_records_no_mtp_loss(build, batch):
    model = build()
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip")
    train_step(model, batch)
    assert tiny_models.recorded_mtp_loss() == 0.0


def test_a_skip_decision_leaves_every_mtp_gradient_none(build, batch):
    model = build()
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip")
    train_step(model, batch)
    mtp_grads = {n: p.grad for n, p in model.named_parameters() if n.startswith("mtp.")}
    assert mtp_grads and all(g is None for g in mtp_grads.values())


def test_a_skip_returns_the_same_lm_loss_as_a_run(build, batch):
    model = build()
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=run")
    run_loss = model(*batch.args(), labels=batch.labels)
    mtp_hooks.configure("train=skip")
    skip_loss = model(*batch.args(), labels=batch.labels)
    assert torch.equal(run_loss, skip_loss)


def test_a_skip_gives_the_gradients_of_a_zero_mtp_loss_scale(build, batch):
    skipped = build(seed=5)
    zero_scaled = build(seed=5, mtp_loss_scaling_factor=0.0)
    mtp_hooks.attach(skipped)
    mtp_hooks.configure("train=skip")
    train_step(skipped, batch)
    train_step(zero_scaled, batch)
    g_skip, g_zero = grads(skipped), grads(zero_scaled)
    for name, g in g_skip.items():
        if not name.startswith("mtp."):
            torch.testing.assert_close(g, g_zero[name], rtol=0, atol=0, msg=name)


def test_eval_alone_does_not_stop_mtp_in_megatron(build, batch, count_mtp):
    model = build()
    counter = count_mtp(model)
    model.eval()
    with torch.no_grad():
        model(*batch.args(), labels=batch.labels)
    assert counter.n == 1  # the baseline mtp-hooks exists to change


def test_the_eval_phase_follows_the_policy(build, batch, count_mtp):
    model = build()
    counter = count_mtp(model)
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("train=run,eval=skip")
    model.eval()
    with torch.no_grad():
        logits = model(*batch.args())
    assert counter.n == 0 and logits.shape[-1] == tiny_models.TinySpec().vocab_size
    assert handle.stats() == {"eval": {"skip": 1}}


def test_train_mode_without_grad_is_the_eval_phase(build, batch):
    model = build()
    handle = mtp_hooks.attach(model)
    with torch.no_grad():
        model(*batch.args(), labels=batch.labels)
    assert handle.stats() == {"eval": {"run": 1}}


def test_an_explicit_phase_wins_over_the_module_state(build, batch, count_mtp):
    model = build()
    counter = count_mtp(model)
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("train=run,rollout=skip")
    with torch.no_grad(), mtp_hooks.phase("rollout"):
        model(*batch.args(), labels=batch.labels)
    assert counter.n == 0 and handle.stats() == {"rollout": {"skip": 1}}


def test_decisions_follow_the_policy_call_by_call(build, batch, count_mtp):
    model = build()
    counter = count_mtp(model)
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("train=run,eval=skip")
    for _ in range(2):
        train_step(model, batch)
        with torch.no_grad():
            model(*batch.args(), labels=batch.labels)
    assert counter.n == 2
    assert handle.stats() == {"eval": {"skip": 2}, "train": {"run": 2}}


def test_the_shared_config_object_is_never_replaced_or_mutated(build, batch):
    model = build()
    shared = model.config
    before = dict(vars(shared))
    seen = []
    model.decoder.register_forward_pre_hook(lambda m, a: seen.append((model.config, m.config)))
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip")
    train_step(model, batch)
    ((model_config_during, decoder_config_during),) = seen
    assert model_config_during is not shared and model_config_during.mtp_num_layers is None
    assert decoder_config_during is shared and model.mtp.config is shared
    assert model.config is shared and vars(shared) == before


def test_labels_none_still_attaches_the_mtp_loss_without_hooks_on_0_19(build, batch):
    import inspect

    from megatron.core.transformer import multi_token_prediction as mtp

    if "input_ids" not in inspect.signature(getattr(mtp, "process_mtp_loss", lambda: 0)).parameters:
        pytest.skip("this megatron-core does not derive MTP labels from input_ids (0.19+ does)")
    model = build()
    model(*batch.args()).sum().backward()
    assert tiny_models.recorded_mtp_loss() > 0


def test_labels_none_with_a_skip_decision_attaches_no_mtp_loss(build, batch, count_mtp):
    model = build()
    counter = count_mtp(model)
    mtp_hooks.attach(model)
    with mtp_hooks.phase("rollout"):
        mtp_hooks.configure("rollout=skip")
        model(*batch.args()).sum().backward()
    assert counter.n == 0 and tiny_models.recorded_mtp_loss() == 0.0
    assert all(p.grad is None for n, p in model.named_parameters() if n.startswith("mtp."))

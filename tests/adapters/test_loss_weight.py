"""A per-phase MTP loss weight on real models: exactly what a model built with that weight does.

The weight reaches megatron through the config it reads at forward time (the per-call copy a
skip also uses); the shared config never changes, and the backward of a forward uses the weight
that forward was given.
"""

from __future__ import annotations

import pytest
import torch

import mtp_hooks
from mtp_hooks.demo import tiny_models

from model_fixtures import Paused, forward_in, native, train_step


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in ((a[k], b[k]) for k in a)
    )


@pytest.mark.parametrize("flag", ["gates", "native-flag"])
def test_a_weight_gives_exactly_the_gradients_of_a_model_built_with_it(build, kind, batch, flag):
    cls = {"model_cls": native(kind)} if flag == "native-flag" else {}
    hooked = build(seed=5, **cls)  # built with the default weight, 0.1
    built = build(seed=5, mtp_loss_scaling_factor=0.3, **cls)
    shared = hooked.config
    mtp_hooks.attach(hooked)
    mtp_hooks.configure("train=run:0.3")
    expected_loss, expected = train_step(built, batch)
    loss, grads = train_step(hooked, batch)
    assert torch.equal(loss, expected_loss) and same(grads, expected)
    assert hooked.config is shared and shared.mtp_loss_scaling_factor == 0.1


def test_the_mtp_part_scales_with_the_weight_and_the_lm_part_is_unchanged(build, batch):
    model = build(seed=6)
    mtp_hooks.attach(model)
    grads = {}
    for policy in ("train=skip", "train=run:0", "train=run:0.1", "train=run:0.3"):
        mtp_hooks.configure(policy)
        grads[policy] = train_step(model, batch)[1]
    trunk = [n for n in grads["train=skip"] if not n.startswith("mtp.")]
    lm_only, zero = grads["train=skip"], grads["train=run:0"]
    assert all(torch.equal(lm_only[n], zero[n]) for n in trunk)  # the LM gradient alone
    for name, at_zero in zero.items():
        mtp_part_1 = grads["train=run:0.1"][name] - at_zero
        mtp_part_3 = grads["train=run:0.3"][name] - at_zero
        torch.testing.assert_close(mtp_part_3, 3 * mtp_part_1, rtol=1e-3, atol=1e-5)
    mtp_grads = [g for n, g in grads["train=run:0.3"].items() if n.startswith("mtp.")]
    assert max(float(g.abs().max()) for g in mtp_grads) > 1e-3  # far above the tolerance


def test_a_zero_weight_still_computes_mtp(build, batch, count_mtp):
    model = build()
    counter = count_mtp(model)
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("train=run:0")
    train_step(model, batch)
    assert counter.n == 1 and tiny_models.recorded_mtp_loss() > 0
    assert handle.stats() == {"train": {"run": 1, "loss_scale": 0.0}}


def test_the_backward_uses_the_weight_of_its_forward(build, batch):
    model, built = build(seed=7), build(seed=7, mtp_loss_scaling_factor=0.3)
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=run:0.3")
    model.train()
    loss = model(*batch.args(), labels=batch.labels)
    mtp_hooks.configure("train=run:0.01")  # changed between forward and backward
    loss.sum().backward()
    _, expected = train_step(built, batch)
    assert same({n: p.grad for n, p in model.named_parameters()}, expected)


def test_a_weighted_forward_in_one_thread_is_refused_while_another_runs_unweighted(build, batch):
    model = build()
    mtp_hooks.attach(model)
    mtp_hooks.configure("eval=run,rollout=run:0.3")
    paused = Paused(model, batch, "eval")
    with pytest.raises(mtp_hooks.MTPHooksError, match="another thread"):
        forward_in(model, batch, "rollout")
    paused.finish()

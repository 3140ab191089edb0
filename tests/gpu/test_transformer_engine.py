"""Transformer Engine layer specs, bf16 and FP8: what a skip keeps and what it changes.

Skipped without CUDA or without ``transformer_engine``. The models are megatron's own TE specs
(``get_gpt_layer_with_transformer_engine_spec`` with ``get_gpt_mtp_block_spec(...,
use_transformer_engine=True)``, and the TE-based ``hybrid_stack_spec`` with the pattern
``*-*-/*-``), in bf16. docs/benchmarks.md records a run on an H200
(``docs/benchmarks/gpu_tests.log``).

* A skipped forward gives the eval logits, the eval loss, the rollout logits and the training
  gradients of the same trunk built without MTP, bit for bit.
* Training with the decision changing between steps (``run:0.3``, then ``skip``), in bf16 and
  with the FP8 ``delayed`` and ``tensorwise`` recipes: losses stay finite, and on a skipped
  step the MTP weights and the FP8 scaling state of the MTP modules stay as they were.
* ``freeze_mtp``, ``freeze_trunk``, ``eval=run+metrics`` and ``run:W`` work on TE modules.
* ``train=run+detach`` leaves the trunk, embedding and output-layer gradients of a skipped
  forward bit for bit, in bf16 and FP8 ``tensorwise``, while the MTP weights get gradients.
* A skip launches exactly the CUDA kernels of the trunk built without MTP, and hooks that say
  *run* exactly those of the model without hooks (counted with torch's profiler): what the
  timings of ``benchmarks/gpu_mtp.py`` compare, without their jitter.
"""

from __future__ import annotations

import collections
import math

import pytest
import torch

import mtp_hooks
from mtp_hooks.demo import tiny_models

from dispatch_counts import dispatched, phase_steps
from model_fixtures import has_transformer_engine

pytestmark = [
    pytest.mark.skipif(
        not has_transformer_engine(), reason="needs a CUDA GPU and transformer_engine"
    ),
    pytest.mark.usefixtures("cuda_mtp_tracker"),
]

SEQ, BATCH, VOCAB = 128, 2, 1024
RECIPES = ["bf16", "delayed", "tensorwise"]


@pytest.fixture(params=["gpt", "hybrid"])
def kind(request) -> str:
    return request.param


def build(kind: str, mtp: bool = True, recipe: str = "bf16", seed: int = 0):
    spec = tiny_models.TinySpec(
        hidden_size=256,
        num_layers=2,
        num_attention_heads=4,
        ffn_hidden_size=1024,
        vocab_size=VOCAB,
        seq_length=SEQ,
        mtp_num_layers=1 if mtp else None,
        swiglu=True,
        rmsnorm=True,
        bias=False,
        params_dtype=torch.bfloat16,
    )
    fp8 = {} if recipe == "bf16" else {"fp8": "hybrid", "fp8_recipe": recipe}
    torch.manual_seed(seed)
    if kind == "gpt":
        model = tiny_models.build_gpt(spec, transformer_impl="transformer_engine", **fp8)
    else:
        pattern = "*-*-/*-" if mtp else "*-*-"
        model = tiny_models.build_hybrid(
            spec, transformer_impl="transformer_engine", pattern=pattern, **fp8
        )
    return model.cuda()


def batch(seed: int = 7):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=g)
    pos = torch.arange(SEQ, device="cuda").unsqueeze(0).expand(BATCH, -1)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=g)
    return ids, pos, labels


def trunk_twin(kind: str, model):
    """The same architecture built without MTP, holding ``model``'s trunk weights."""
    plain = build(kind, mtp=False)
    trunk = {k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")}
    missing, unexpected = plain.load_state_dict(trunk, strict=False)
    assert [k for k in missing if not k.endswith("_extra_state")] == []
    assert unexpected == []
    return plain


def mtp_state(model) -> dict[str, torch.Tensor]:
    """The MTP weights and the FP8 scaling state (scales, amax histories) of MTP modules."""
    state = {f"param:{n}": p.detach().clone() for n, p in model.mtp.named_parameters()}
    for name, module in model.mtp.named_modules():
        meta = getattr(module, "fp8_meta", None)
        if not isinstance(meta, dict):
            continue
        for key in ("scaling_fwd", "scaling_bwd"):
            scaling = meta.get(key)
            for field in ("scale", "amax_history"):
                value = getattr(scaling, field, None)
                if torch.is_tensor(value):
                    state[f"{key}.{field}:{name}"] = value.detach().clone()
    return state


def changed(before: dict, after: dict) -> list[str]:
    return [k for k in before if not torch.equal(before[k], after[k])]


def test_a_skip_is_bit_identical_to_the_trunk_built_without_mtp(kind):
    model = build(kind)
    plain = trunk_twin(kind, model)
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip,eval=skip,rollout=skip")
    ids, pos, labels = batch()
    ran = tiny_models.MTPForwards(model)
    for m in (model, plain):
        m.eval()
    with torch.no_grad():
        assert torch.equal(model(ids, pos, None), plain(ids, pos, None))  # eval logits
        assert torch.equal(
            model(ids, pos, None, labels=labels), plain(ids, pos, None, labels=labels)
        )  # eval loss
        with mtp_hooks.phase("rollout"):
            assert torch.equal(model(ids, pos, None), plain(ids, pos, None))
    for m in (model, plain):
        m.train()
        m(ids, pos, None, labels=labels).float().sum().backward()
    grads = dict(plain.named_parameters())
    for name, param in model.named_parameters():
        if name.startswith("mtp."):
            assert param.grad is None, name
        else:
            assert torch.equal(param.grad, grads[name].grad), name
    assert ran.n == 0 and handle.stats()["train"] == {"skip": 1}


def kernels(step) -> collections.Counter[str]:
    """The CUDA kernels ``step()`` launches, by name, counted after one warm-up call."""
    return dispatched(step, "cuda")


def te_steps(model):
    """A train step, a log-prob forward and an eval forward of ``model``."""
    ids, pos, labels = batch()
    return phase_steps(model, (ids, pos, None), labels)


@pytest.mark.parametrize("recipe", ["bf16", "tensorwise"])
def test_a_skip_launches_exactly_the_kernels_of_the_trunk_built_without_mtp(kind, recipe):
    model = build(kind, recipe=recipe)
    plain = build(kind, mtp=False, recipe=recipe)
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip,rollout=skip,eval=skip")
    for name, step in te_steps(model).items():
        skipped, built = kernels(step), kernels(te_steps(plain)[name])
        print(name, sum(skipped.values()), "kernels")
        assert sum(skipped.values()) > 20, name
        assert skipped == built, (name, skipped - built, built - skipped)


@pytest.mark.parametrize("recipe", ["bf16", "tensorwise"])
def test_hooks_that_say_run_launch_exactly_the_kernels_of_the_model_without_hooks(kind, recipe):
    model = build(kind, recipe=recipe)
    bare = {name: kernels(step) for name, step in te_steps(model).items()}
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=run,rollout=run,eval=run")
    for name, step in te_steps(model).items():
        hooked = kernels(step)
        assert hooked == bare[name], (name, hooked - bare[name], bare[name] - hooked)


@pytest.mark.parametrize("recipe", RECIPES)
def test_decisions_changing_between_steps_train_and_leave_skipped_mtp_still(kind, recipe):
    model = build(kind, recipe=recipe)
    mtp_hooks.attach(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    ids, pos, labels = batch()
    model.train()
    losses, still, moved = [], [], []
    for step in range(6):
        run = step % 2 == 0
        mtp_hooks.configure("train=run:0.3" if run else "train=skip")
        before = mtp_state(model)
        optimizer.zero_grad(set_to_none=True)
        loss = model(ids, pos, None, labels=labels).float().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        diff = changed(before, mtp_state(model))
        (moved if run else still).append(diff)
    assert all(math.isfinite(v) for v in losses), losses
    assert still == [[], [], []], f"changed on skipped steps: {still}"
    assert all(any(k.startswith("param:") for k in diff) for diff in moved), moved
    if recipe == "delayed":  # the scaling state exists from the first FP8 step on, then moves
        assert all(any(k.startswith("scaling_") for k in diff) for diff in moved[1:]), moved


def test_freeze_mtp_keeps_te_mtp_weights_bit_identical_while_mtp_trains_the_trunk(kind):
    model = build(kind)
    frozen = mtp_hooks.megatron.freeze_mtp(model)
    assert frozen and all(n.startswith("mtp.") for n in frozen)
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=run")
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    before = mtp_state(model)
    trunk = model.embedding.word_embeddings.weight.detach().clone()
    ids, pos, labels = batch()
    ran = tiny_models.MTPForwards(model)
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        model(ids, pos, None, labels=labels).float().mean().backward()
        optimizer.step()
    assert ran.n == 2
    assert [k for k in changed(before, mtp_state(model)) if k.startswith("param:")] == []
    assert not torch.equal(trunk, model.embedding.word_embeddings.weight)


def test_eval_metrics_are_recorded_from_te_modules(kind):
    model = build(kind)
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("eval=run+metrics")
    ids, pos, labels = batch()
    model.eval()
    with torch.no_grad():
        model(ids, pos, None, labels=labels)
    metrics = handle.metrics()["eval"]
    assert metrics.forwards == 1 and metrics.tokens[0] > 0
    assert math.isfinite(metrics.loss[0]) and metrics.loss[0] > 0
    assert 0.0 <= metrics.acceptance[0] <= 1.0


def test_a_loss_weight_scales_the_mtp_gradients_of_te_modules(kind):
    model = build(kind)
    mtp_hooks.attach(model)
    ids, pos, labels = batch()
    model.train()
    grads = {}
    for weight in (0.1, 0.3):
        mtp_hooks.configure(f"train=run:{weight}")
        model.zero_grad(set_to_none=True)
        model(ids, pos, None, labels=labels).float().mean().backward()
        grads[weight] = {
            n: p.grad.float().clone() for n, p in model.mtp.named_parameters() if p.grad is not None
        }
    assert grads[0.1]
    for name, low in grads[0.1].items():
        if low.abs().sum() > 0:
            ratio = grads[0.3][name].norm() / low.norm()
            assert abs(ratio.item() - 3.0) < 0.05, (name, ratio.item())


@pytest.mark.parametrize("recipe", ["bf16", "tensorwise"])
def test_a_detached_mtp_forward_leaves_the_trunk_gradients_of_a_skip_on_te_modules(kind, recipe):
    model = build(kind, recipe=recipe)
    mtp_hooks.megatron.clip_mtp_apart(model)
    mtp_hooks.attach(model)
    ids, pos, labels = batch()
    model.train()
    ran = tiny_models.MTPForwards(model)
    grads, losses = {}, {}
    for policy in ("train=skip", "train=run+detach"):
        mtp_hooks.configure(policy)
        model.zero_grad(set_to_none=True)
        loss = model(ids, pos, None, labels=labels).float().mean()
        loss.backward()
        losses[policy] = loss.detach()
        grads[policy] = {n: p.grad for n, p in model.named_parameters()}
    assert ran.n == 1
    assert torch.equal(losses["train=skip"], losses["train=run+detach"])
    skipped, detached = grads["train=skip"], grads["train=run+detach"]
    for name, grad in skipped.items():
        if name.startswith("mtp."):
            assert grad is None, name
        else:
            assert torch.equal(grad, detached[name]), name
    assert any(g is not None and g.abs().sum() > 0 for n, g in detached.items() if "mtp." in n)


def test_freeze_trunk_keeps_the_te_trunk_bit_identical_while_mtp_trains(kind):
    model = build(kind)
    frozen = mtp_hooks.megatron.freeze_trunk(model)
    assert frozen and not any(n.startswith("mtp.") for n in frozen)
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=run")
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    trunk = {n: p.detach().clone() for n, p in model.named_parameters() if n in frozen}
    before = mtp_state(model)
    ids, pos, labels = batch()
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        model(ids, pos, None, labels=labels).float().mean().backward()
        optimizer.step()
    moved = [n for n, p in model.named_parameters() if n in trunk and not torch.equal(p, trunk[n])]
    assert moved == []
    assert [k for k in changed(before, mtp_state(model)) if k.startswith("param:")]

"""``+detach`` on real models: for one forward, MTP trains on detached inputs, as a model built
with megatron's ``mtp_detach_heads=True`` does, and the policy, trunk and configs stay untouched.

megatron-core reads the flag from the model's config (the output weight), the MTP block's (the
trunk's hidden states) and each MTP layer's (the embeddings); the gate hands all three a view.
Where megatron-core has no such field (before 0.19), ``+detach`` is refused before any forward.
"""

from __future__ import annotations

import pytest
import torch

import mtp_hooks
from mtp_hooks.demo import tiny_models

from model_fixtures import (
    VOCAB,
    Paused,
    deepcopy_model,
    forward_in,
    has_detach_field,
    train_step,
)
from plugin_answers import answers

needs_field = pytest.mark.skipif(
    not has_detach_field(), reason="mtp_detach_heads came in megatron-core 0.19"
)


def configs(model) -> list:
    return [m.config for m in (model, model.mtp, *model.mtp.layers)]


@pytest.fixture
def build(build):
    """The models of ``model_fixtures.build``, with their MTP weights clipped apart as
    ``+detach`` requires (where this megatron-core can)."""

    def make(*args, **kwargs) -> torch.nn.Module:
        model = build(*args, **kwargs)
        if has_detach_field():
            mtp_hooks.megatron.clip_mtp_apart(model)
        return model

    return make


def untag(model) -> None:
    """Take the MTP weights out of megatron's gradient-norm group, as a model is built."""
    for param in model.mtp.parameters():
        del param.grad_norm_group


@needs_field
@pytest.mark.parametrize("share_embeddings", [False, True])
def test_a_detached_forward_gives_the_trunk_exactly_the_gradients_of_a_skipped_one(
    build, batch, share_embeddings
):
    model = build(seed=11, share_embeddings=share_embeddings)
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip")
    _, skipped = train_step(model, batch)
    mtp_hooks.configure("train=run+detach")
    _, detached = train_step(model, batch)
    trunk = [n for n in skipped if not n.startswith("mtp.")]
    assert any("embedding" in n for n in trunk)
    assert share_embeddings or any(n.startswith("output_layer") for n in trunk)
    assert all(torch.equal(skipped[n], detached[n]) for n in trunk)
    mtp = [g for n, g in detached.items() if n.startswith("mtp.")]
    assert all(g is not None for g in mtp) and max(float(g.abs().max()) for g in mtp) > 1e-4
    mtp_hooks.configure("train=run")  # and attached, the MTP loss does reach the trunk
    _, attached = train_step(model, batch)
    assert not all(torch.equal(skipped[n], attached[n]) for n in trunk)


@needs_field
@pytest.mark.parametrize("weight", ["", ":0.3"])
def test_every_gradient_equals_that_of_a_model_built_with_mtp_detach_heads(build, batch, weight):
    hooked = build(seed=12)
    scale = {"mtp_loss_scaling_factor": 0.3} if weight else {}
    built = build(seed=12, mtp_detach_heads=True, **scale)
    before = configs(hooked)
    handle = mtp_hooks.attach(hooked)
    mtp_hooks.configure(f"train=run{weight}+detach")
    expected_loss, expected = train_step(built, batch)
    loss, grads = train_step(hooked, batch)
    assert torch.equal(loss, expected_loss) and grads.keys() == expected.keys()
    assert all(torch.equal(grads[n], expected[n]) for n in grads)
    assert configs(hooked) == before and all(c is before[0] for c in before)
    assert before[0].mtp_detach_heads is False
    stats = handle.stats()["train"]
    assert stats["run"] == stats["detached"] == 1


@needs_field
def test_the_loss_of_a_detached_forward_equals_the_undetached_one(build, batch, count_mtp):
    model = build(seed=13)
    counter = count_mtp(model)
    mtp_hooks.attach(model)
    seen = []
    for policy in ("train=run", "train=run+detach"):
        mtp_hooks.configure(policy)
        tiny_models.reset_mtp_loss_tracker()
        loss, _ = train_step(model, batch)
        seen.append((loss, tiny_models.recorded_mtp_loss()))
    assert torch.equal(seen[0][0], seen[1][0])
    assert seen[0][1] == seen[1][1] > 0 and counter.n == 2


@needs_field
@pytest.mark.parametrize("raised", [RuntimeError, KeyboardInterrupt])
def test_a_detached_forward_that_raises_inside_mtp_leaves_every_config_as_it_was(
    build, batch, raised
):
    model = build()
    before = configs(model)
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("train=run+detach")

    def fail(*_):
        raise raised("inside the MTP layer")

    hook = model.mtp.layers[0].register_forward_pre_hook(fail)
    model.train()
    with pytest.raises(raised):
        model(*batch.args(), labels=batch.labels)
    hook.remove()
    if raised is KeyboardInterrupt:  # torch ran no hook: the next forward repairs it
        assert configs(model)[1].mtp_detach_heads is True
        mtp_hooks.configure("train=run")
        train_step(model, batch)
    assert configs(model) == before
    handle.remove()
    assert configs(model) == before


@needs_field
def test_remove_after_an_interrupted_detached_forward_restores_every_config(build, batch):
    model = build()
    before = configs(model)
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("train=run+detach")

    def interrupt(*_):
        raise KeyboardInterrupt

    hook = model.mtp.register_forward_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        model(*batch.args(), labels=batch.labels)
    hook.remove()
    handle.remove()
    assert configs(model) == before and model.mtp_process is True


@needs_field
def test_a_forward_nested_in_a_detached_one_runs_its_own_decision(build, batch):
    model = build()
    before = configs(model)
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=run+detach,eval=run")
    seen = []

    def look(module, args):
        seen.append(module.config.mtp_detach_heads)
        if len(seen) == 1:
            with torch.no_grad(), mtp_hooks.phase("eval"):
                model(*batch.args(), labels=batch.labels)
            seen.append(module.config.mtp_detach_heads)

    hook = model.mtp.layers[0].register_forward_pre_hook(look)
    train_step(model, batch)
    hook.remove()
    assert seen == [True, False, True]
    assert configs(model) == before


@needs_field
def test_a_deep_copy_taken_inside_a_detached_forward_starts_with_its_own_configs(build, batch):
    model = build()
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=run+detach")
    copies = []
    hook = model.mtp.register_forward_pre_hook(lambda *_: copies.append(deepcopy_model(model)))
    train_step(model, batch)
    hook.remove()
    twin = copies[0]
    assert [type(c).__name__ for c in configs(twin)][1] == "TransformerConfig"
    # torch deep-copies a parameter's data, not its Python attributes (megatron's tags too):
    # the copy's optimizer would clip globally, so its detached forward is refused until tagged
    with pytest.raises(mtp_hooks.UnsupportedModelError, match="clip_mtp_apart"):
        train_step(twin, batch)
    mtp_hooks.megatron.clip_mtp_apart(twin)
    train_step(twin, batch)  # its first forward puts the copied block's own config back
    assert all(c.mtp_detach_heads is False for c in configs(twin))
    assert all(type(c).__name__ == "TransformerConfig" for c in configs(twin))


@needs_field
def test_a_detached_forward_is_refused_while_another_thread_runs_one_attached(build, batch):
    model = build()
    before = configs(model)
    mtp_hooks.attach(model)
    mtp_hooks.configure("eval=run,rollout=run+detach")
    paused = Paused(model, batch, "eval")
    with pytest.raises(mtp_hooks.MTPHooksError, match="another thread"):
        forward_in(model, batch, "rollout")
    paused.finish()
    assert configs(model) == before


@needs_field
@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_detach_is_refused_at_attach_on_a_model_with_cuda_graphs(build, batch, impl):
    from test_attach import graphed

    model = graphed(build(), impl)  # the config says so, and local graphs have managers
    mtp_hooks.configure("train=run+detach")
    with pytest.raises(mtp_hooks.UnsupportedModelError) as info:
        mtp_hooks.attach(model)
    assert f"cuda_graph_impl={impl!r}" in str(info.value) and not model._forward_pre_hooks
    mtp_hooks.configure("train=run")
    mtp_hooks.attach(model)
    train_step(model, batch)


@pytest.mark.skipif(has_detach_field(), reason="this megatron-core has mtp_detach_heads")
def test_detach_is_refused_at_attach_where_megatron_core_has_no_mtp_detach_heads(build):
    model = build()
    mtp_hooks.configure("eval=run+detach")
    with pytest.raises(mtp_hooks.UnsupportedModelError) as info:
        mtp_hooks.attach(model)
    message = str(info.value)
    assert "the policy config asks to detach MTP in eval" in message
    assert "mtp_detach_heads" in message
    assert "Upgrade megatron-core (0.17 and later need Python 3.12), or drop '+detach'" in message
    assert not model._forward_pre_hooks


@pytest.mark.skipif(has_detach_field(), reason="this megatron-core has mtp_detach_heads")
def test_an_objective_is_refused_at_attach_where_megatron_core_cannot_detach(build):
    """``kl`` and ``tv`` need ``+detach``: on megatron-core 0.16-0.18 they are refused at
    attach, before any forward, with the detach refusal's fix (upgrade)."""
    model = build()
    mtp_hooks.configure("train=run+detach+objective:kl")
    with pytest.raises(mtp_hooks.UnsupportedModelError) as info:
        mtp_hooks.attach(model)
    message = str(info.value)
    assert "mtp_detach_heads" in message and "Upgrade megatron-core" in message
    assert "clips one global gradient norm" in message  # why hooks alone could not keep it
    assert not model._forward_pre_hooks


@pytest.mark.skipif(has_detach_field(), reason="this megatron-core has mtp_detach_heads")
def test_detach_configured_after_attach_is_refused_at_the_next_forward(build, batch, count_mtp):
    model = build()
    config, counter = model.config, count_mtp(model)
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=run+detach")
    with pytest.raises(mtp_hooks.UnsupportedModelError, match="mtp_detach_heads"):
        train_step(model, batch)
    assert model.config is config and counter.n == 0
    mtp_hooks.configure("train=run")
    train_step(model, batch)
    assert counter.n == 1


@needs_field
def test_detach_is_refused_at_attach_while_the_mtp_weights_share_the_trunks_gradient_clip(
    build,
):
    model = build()
    untag(model)
    mtp_hooks.configure("train=run+detach")
    with pytest.raises(mtp_hooks.UnsupportedModelError) as info:
        mtp_hooks.attach(model)
    message = str(info.value)
    assert "the policy config asks to detach MTP in train" in message
    assert "'mtp' gradient-norm group" in message and "clip_mtp_apart(model)" in message
    assert not model._forward_pre_hooks
    mtp_hooks.megatron.clip_mtp_apart(model)
    mtp_hooks.attach(model)


@needs_field
def test_detach_asked_after_attach_by_a_plugin_is_refused_before_mtp_runs(build, batch, count_mtp):
    model = build()
    untag(model)
    config, counter = model.config, count_mtp(model)
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=run")
    train_step(model, batch)

    answers("mtp_detach_heads", True, name="detacher")
    with pytest.raises(mtp_hooks.UnsupportedModelError, match="plugin detacher asks to detach"):
        train_step(model, batch)
    assert model.config is config and counter.n == 1
    assert all(c.mtp_detach_heads is False for c in configs(model))


@needs_field
def test_a_model_built_with_mtp_detach_heads_is_already_clipped_apart(build, batch):
    model = build(mtp_detach_heads=True)
    untag(model)  # as the fixture found it: megatron's own tags, removed and put back
    model = build(mtp_detach_heads=True)
    assert {p.grad_norm_group for p in model.mtp.parameters()} == {"mtp"}
    mtp_hooks.configure("train=run+detach")
    mtp_hooks.attach(model)
    train_step(model, batch)


@needs_field
def test_clip_mtp_apart_tags_exactly_the_mtp_block_and_is_idempotent(build):
    model = build()
    untag(model)
    names = mtp_hooks.megatron.clip_mtp_apart(model)
    assert names == [f"mtp.{n}" for n, _ in model.mtp.named_parameters()]
    assert mtp_hooks.megatron.clip_mtp_apart(model) == names
    grouped = {n for n, p in model.named_parameters() if hasattr(p, "grad_norm_group")}
    assert grouped == set(names) and not any(n.startswith("embedding") for n in grouped)


@needs_field
def test_clip_mtp_apart_is_refused_after_the_ddp_wrap_and_changes_nothing(build):
    model = build()
    untag(model)
    for param in model.parameters():  # what megatron's DDP gives every parameter it buckets
        param.main_grad = torch.zeros_like(param)
    with pytest.raises(mtp_hooks.UnsupportedModelError, match="before the model is wrapped"):
        mtp_hooks.megatron.clip_mtp_apart(model)
    assert not any(hasattr(p, "grad_norm_group") for p in model.parameters())


@needs_field
def test_clip_mtp_apart_leaves_a_parameter_of_another_group_and_everything_else_alone(build):
    model = build()
    untag(model)
    first = next(model.mtp.parameters())
    first.grad_norm_group = "experts"
    with pytest.raises(mtp_hooks.UnsupportedModelError, match=r"mtp\.\S+ \('experts'\)"):
        mtp_hooks.megatron.clip_mtp_apart(model)
    assert [getattr(p, "grad_norm_group", None) for p in model.mtp.parameters()][:2] == [
        "experts",
        None,
    ]


@pytest.mark.skipif(has_detach_field(), reason="this megatron-core has gradient-norm groups")
def test_clip_mtp_apart_is_refused_where_the_optimizer_has_no_separate_groups(build):
    model = build()
    with pytest.raises(mtp_hooks.UnsupportedModelError, match="SEPARATE_GRAD_NORM_GROUPS"):
        mtp_hooks.megatron.clip_mtp_apart(model)
    assert not any(hasattr(p, "grad_norm_group") for p in model.parameters())
    with pytest.raises(mtp_hooks.UnsupportedModelError, match="SEPARATE_GRAD_NORM_GROUPS"):
        mtp_hooks.auto_attach(clip_mtp_apart=True)
    from mtp_hooks import _runtime

    assert _runtime.process.auto.registration is None  # auto-attach stayed off


@needs_field
def test_auto_attach_can_clip_mtp_apart_as_the_model_is_built_so_detach_needs_no_call(kind, batch):
    """Megatron-LM's pretrain() and train_rl.py build the model, wrap it and build the
    optimizer in one call: the tag has to be set while the model is built."""
    builder = tiny_models.build_gpt if kind == "gpt" else tiny_models.build_hybrid
    spec = tiny_models.TinySpec(seq_length=batch.labels.shape[1], vocab_size=VOCAB)
    mtp_hooks.auto_attach(clip_mtp_apart=True)
    try:
        model = builder(spec)  # the bare model, as megatron builds it: nothing tags it after
    finally:
        mtp_hooks.auto_attach(False)
    assert {p.grad_norm_group for p in model.mtp.parameters()} == {"mtp"}
    trunk = [p for n, p in model.named_parameters() if not n.startswith("mtp.")]
    assert not any(hasattr(p, "grad_norm_group") for p in trunk)
    mtp_hooks.configure("train=run+detach")
    train_step(model, batch)  # attached at this first forward: +detach is not refused
    assert mtp_hooks.attach(model).stats()["train"] == {"run": 1, "detached": 1}

"""A Nemotron-3-shaped ``HybridModel`` on Transformer Engine, bf16 and FP8, on one GPU.

The model is tests/gpu/nemotron_on_gpu.py's: megatron's own TE ``hybrid_stack_spec`` with a
Mamba-2, attention and MoE trunk and two attention + MoE MTP depths. Skipped without CUDA,
Transformer Engine or mamba-ssm; the engine tests also need FlashAttention and causal-conv1d.

Where the arithmetic is the same the tests demand the same bits; elsewhere a comparison is
held against the same computation's own run-to-run spread (the model built without MTP, run
twice on the same batch). CUDA graphs, activation recompute and megatron's distributed
checkpoint on this model are in test_nemotron_training_machinery.py.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import SimpleNamespace

import pytest
import torch

import mtp_hooks
from mtp_hooks.demo import nemotron_models, tiny_models

from engine_rollouts import assert_attaching_changes_no_rollout
from model_fixtures import has_detach_field
from nemotron_on_gpu import (
    DEPTHS,
    MARKS,
    PATTERN,
    batch,
    build,
    grads_of,
    spec,
    trunk,
    trunk_twin,
    within_spread,
)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "rl_drafter"))

pytestmark = MARKS


def test_a_skip_gives_the_trunks_logits_bit_for_bit_and_its_gradients_within_their_spread():
    model = build(seed=1)
    plain = trunk_twin(model)
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip,eval=skip,rollout=skip")
    ids, pos, labels = data = batch()
    for m in (model, plain):
        m.eval()
    with torch.no_grad():
        assert torch.equal(model(ids, pos, None), plain(ids, pos, None))
        assert torch.equal(
            model(ids, pos, None, labels=labels), plain(ids, pos, None, labels=labels)
        )
        with mtp_hooks.phase("rollout"):
            assert torch.equal(model(ids, pos, None), plain(ids, pos, None))
    loss, grads = grads_of(model, data)
    plain_loss, reference = grads_of(plain, data)
    _, again = grads_of(plain, data)
    assert torch.equal(loss, plain_loss)
    assert all(g is None for n, g in grads.items() if n.startswith("mtp."))
    assert within_spread("skip", trunk(grads), reference, again) == []
    assert handle.stats()["train"] == {"skip": 1}


@pytest.mark.skipif(not has_detach_field(), reason="+detach needs mtp_detach_heads (0.19 on)")
def test_detach_leaves_the_trunk_gradients_those_of_a_skip_within_their_spread():
    model = build(seed=2)
    mtp_hooks.megatron.clip_mtp_apart(model)
    mtp_hooks.attach(model)
    data = batch()
    mtp_hooks.configure("train=skip")
    _, skipped = grads_of(model, data)
    _, skipped_again = grads_of(model, data)
    mtp_hooks.configure("train=run+detach")
    _, detached = grads_of(model, data)
    assert within_spread("detach", trunk(detached), trunk(skipped), trunk(skipped_again)) == []
    assert all(g is not None for n, g in detached.items() if n.startswith("mtp."))


def test_freeze_mtp_keeps_every_mtp_tensor_over_adamw_steps():
    model = build(seed=3)
    mtp_hooks.megatron.freeze_mtp(model)
    before = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("mtp.")}
    before = {k: v for k, v in before.items() if torch.is_tensor(v)}
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=run")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for step in range(3):
        grads_of(model, batch(seed=step))
        optimizer.step()
    after = model.state_dict()
    assert len(before) > 30
    assert [k for k in before if not torch.equal(before[k], after[k])] == []


@pytest.mark.parametrize("recipe", ["bf16", "tensorwise"])
def test_decisions_changing_between_steps_train_and_leave_skipped_mtp_still(recipe):
    # FP8 wants the Mamba input projection's width a multiple of 16: 32-wide heads give that
    model = build(seed=4, recipe=recipe, mamba_head_dim=32)
    mtp_hooks.attach(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    data, losses = batch(), []
    for step in range(4):
        run = step % 2 == 0
        mtp_hooks.configure("train=run:0.3" if run else "train=skip")
        mtp_before = {n: p.detach().clone() for n, p in model.mtp.named_parameters()}
        optimizer.zero_grad(set_to_none=True)
        loss, _ = grads_of(model, data)
        optimizer.step()
        losses.append(loss.float().mean().item())
        moved = [n for n, p in model.mtp.named_parameters() if not torch.equal(p, mtp_before[n])]
        assert bool(moved) is run, (step, moved[:3])
    assert all(torch.isfinite(torch.tensor(losses))), losses


def test_metrics_record_both_depths_and_the_single_position_figures_moving_no_buffer():
    model = build(seed=5)
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("eval=run+metrics")
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    ids, pos, labels = batch()
    model.eval()
    with torch.no_grad():
        model(ids, pos, None, labels=labels)
    figures = handle.metrics()["eval"]
    print("eval figures:", figures)
    assert len(figures.loss) == DEPTHS and figures.accepted_length is not None
    assert figures.single_position_accepted_length is not None
    assert [n for n, b in model.named_buffers() if not torch.equal(b, buffers[n])] == []


def test_one_repeated_mtp_layer_serves_both_depths_and_skips_like_the_trunk():
    model = build(seed=6, repeated_mtp=True)
    assert len(model.mtp.layers) == 1
    plain = trunk_twin(model, repeated_mtp=True)
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=run,eval=skip")
    ran = tiny_models.MTPForwards(model)
    grads_of(model, batch())
    assert ran.n == 1 and tiny_models.recorded_mtp_loss() > 0
    ids, pos, _ = batch()
    for m in (model, plain):
        m.eval()
    with torch.no_grad():
        assert torch.equal(model(ids, pos, None), plain(ids, pos, None))


# -- megatron's inference engine, drafting with the MTP depths over the Mamba state -----------


def _engine_packages() -> bool:
    names = ("flash_attn", "flash_attn_interface", "flash_attn_3", "causal_conv1d")
    found = {n: importlib.util.find_spec(n) is not None for n in names}
    return found["causal_conv1d"] and any(found[n] for n in names[:3])


needs_engine = pytest.mark.skipif(
    not _engine_packages(),
    reason="megatron's engine needs FlashAttention and causal-conv1d for a hybrid",
)


@pytest.fixture(scope="module")
def trained():
    """A Nemotron-3-shaped model trained for 200 steps on the drafter benchmark's phrase
    language, MTP included, so that its depths draft well enough to be accepted."""
    import gpu_rl_drafter as bench

    args = bench.parse_args(
        ["--vocab", "512", "--phrases", "64", "--seq", "128", "--batch", "8", "--prompts", "4"]
        + ["--prompt-len", "16", "--gen", "32", "--lr", "1e-3"]
    )
    tiny_models.init_single_process(port=tiny_models.free_port())
    tiny_models.reset_mtp_loss_tracker(num_layers=DEPTHS, device="cuda")
    torch.manual_seed(0)
    sized = tiny_models.TinySpec(**{**vars(spec()), "vocab_size": args.vocab, "seq_length": 256})
    model = nemotron_models.build_nemotron(
        sized, pattern=PATTERN, transformer_impl="transformer_engine"
    ).cuda()
    trainer = bench.Trainer(model, args.lr, args.clip)
    lang = bench.PhraseLanguage(args.vocab, args.phrases, 1)
    for step in range(200):
        bench.train_step(model, trainer, lang.sample(args.batch, args.seq, (1, step)), "cuda")
    engines = {k: bench.EngineRollouts(model, k, args) for k in (0, 1, 2)}
    prompts = bench.prompts_at(lang, args, 0)
    for engine in engines.values():
        engine(prompts, args.gen)  # FlashAttention compiles per shape on first use
    return SimpleNamespace(model=model, engines=engines, prompts=prompts, args=args, bench=bench)


@needs_engine
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("policy", ["rollout=skip", "train=run+detach,eval=run+metrics"])
def test_the_engine_drafts_the_same_tokens_with_the_library_attached(trained, k, policy):
    engine = trained.engines[k]
    if policy.startswith("train=run+detach"):
        mtp_hooks.megatron.clip_mtp_apart(trained.model)
    plain = assert_attaching_changes_no_rollout(
        trained.model, policy, lambda: engine(trained.prompts, trained.args.gen)
    )
    assert plain.drafts[0] > 0 and plain.accepted[0] > 0


@needs_engine
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_librarys_figures_are_set_against_the_engines_counters(trained, temperature):
    bench, args = trained.bench, trained.args
    for engine in trained.engines.values():
        engine.temperature = temperature
    handle = mtp_hooks.attach(trained.model)
    try:
        mtp_hooks.declare_phase("logprob")
        mtp_hooks.configure("logprob=run+metrics")
        row = bench.measure(trained.model, handle, trained.engines, trained.prompts, args)
    finally:
        handle.remove()
        for engine in trained.engines.values():
            engine.temperature = 0.0
    print(f"temperature {temperature}: engine {row['engine']}")
    print(f"temperature {temperature}: teacher-forced {row['teacher_forced']}")
    engine = row["engine"][2]
    assert engine["drafts"][0] > 0
    figures = row["teacher_forced"]
    assert figures["accepted_length"] is not None
    assert figures["single_position_accepted_length"] is not None

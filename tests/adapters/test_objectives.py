"""MTP trained toward the policy's own distribution (``+objective:kl``, ``+objective:tv``) on
real megatron models: each depth's gradients against a float64 reference computed by hand
from the same logits, the trunk's update that of a skip, megatron's own loss untouched
(``ce``), masks, the RL call (labels derived from ``input_ids``), and the refusals."""

from __future__ import annotations

import pytest
import torch

import mtp_hooks
from mtp_hooks.demo import tiny_models

from model_fixtures import (
    SEQ,
    VOCAB,
    deepcopy_model,
    has_detach_field,
    packed_row,
    train_step,
)

DEPTHS = 2
pytestmark = pytest.mark.skipif(
    not has_detach_field(), reason="kl and tv need +detach: megatron-core 0.19's mtp_detach_heads"
)


@pytest.fixture
def deep(build):
    """``deep(seed)``: a model of the current kind with two MTP depths, clipped apart (and
    megatron's loss tracker sized for two depths)."""
    tiny_models.reset_mtp_loss_tracker(num_layers=DEPTHS)

    def make(seed: int = 0, **kwargs) -> torch.nn.Module:
        spec = tiny_models.TinySpec(seq_length=SEQ, vocab_size=VOCAB, mtp_num_layers=DEPTHS)
        model = build(seed, spec=spec, **kwargs)
        mtp_hooks.megatron.clip_mtp_apart(model)
        return model

    return make


def projections(model, call):
    """``call()`` on ``model`` with megatron's MTP loss at weight 0 and MTP detached (plain
    megatron, no mtp-hooks): the depths' logits and the policy's, as the output layer made them."""
    seen: list[torch.Tensor] = []  # copies: megatron's cross-entropy overwrites the logits

    def keep(layer, args, out):
        seen.append(out[0].clone())

    handle = model.output_layer.register_forward_hook(keep)
    model.config.mtp_loss_scaling_factor, model.config.mtp_detach_heads = 0.0, True
    try:
        result = call()
    finally:
        handle.remove()
    return result, seen[:DEPTHS], seen[DEPTHS]


def by_hand(kind, drafts, policy, mask, temperature, factor):
    """The objective in float64 from the logits ``[s, b, v]``: depth ``d`` at position ``i``
    against the policy at ``i + d``, over positions whose mask rolled ``d`` times is set, each
    depth's mean weighted ``factor / depths`` (megatron's normalisation)."""
    total = torch.zeros((), dtype=torch.float64)
    mask = mask.double()
    for depth, draft in enumerate(drafts, start=1):
        seq = draft.shape[0]
        p = torch.softmax(policy.detach().double() / temperature, dim=-1)[depth:]
        log_q = torch.log_softmax(draft.double() / temperature, dim=-1)[: seq - depth]
        if kind == "kl":
            per = torch.sum(p * (p.log() - log_q), dim=-1)
        else:
            per = torch.sum((log_q.exp() - p).abs(), dim=-1) / 2
        rolled = torch.zeros_like(mask)
        rolled[:, : seq - depth] = mask[:, depth:]
        weights = rolled.t()[: seq - depth]
        total = total + factor / len(drafts) * torch.sum(weights * per) / rolled.sum().clamp(min=1)
    return total


def mtp_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if n.startswith("mtp.")}


@pytest.mark.parametrize(("kind", "temperature"), [("kl", 1.0), ("tv", 1.0), ("kl", 0.7)])
def test_each_objectives_mtp_gradients_equal_a_float64_reference_on_the_same_logits(
    deep, batch, kind, temperature
):
    model = deep(seed=5)
    reference = deepcopy_model(model)
    policy = {"mtp": "run", "detach": True, "objective": kind, "temperature": temperature}
    mtp_hooks.configure({"train": policy})
    mtp_hooks.attach(model)
    _, grads = train_step(model, batch)
    got = {n: g for n, g in grads.items() if n.startswith("mtp.")}

    reference.train()
    loss, drafts, logits = projections(
        reference, lambda: reference(*batch.args(), labels=batch.labels)
    )
    factor = model.config.mtp_loss_scaling_factor
    mine = by_hand(kind, drafts, logits, torch.ones_like(batch.labels), temperature, factor)
    (loss.sum() + mine).backward()
    want = mtp_grads(reference)
    assert set(got) == set(want) and all(g is not None for g in got.values())
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=1e-4, atol=1e-7), name
    assert max(float(g.abs().max()) for g in got.values()) > 1e-6  # not a vanishing case


@pytest.mark.parametrize("kind", ["kl", "tv"])
def test_the_trunk_gets_exactly_the_gradients_of_a_skip(deep, batch, kind):
    model = deep(seed=7)
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip")
    _, skipped = train_step(model, batch)
    skipped = {n: g for n, g in skipped.items() if g is not None}
    mtp_hooks.configure(f"train=run+detach+objective:{kind}")
    _, trained = train_step(model, batch)
    trunk = [n for n in skipped if not n.startswith("mtp.")]
    assert trunk and all(torch.equal(skipped[n], trained[n]) for n in trunk)
    assert all(trained[n] is not None for n in trained if n.startswith("mtp."))


def test_ce_is_megatrons_own_loss_bit_for_bit(deep, batch):
    model = deep(seed=3)
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=run+detach")
    loss, plain = train_step(model, batch)
    mtp_hooks.configure("train=run+detach+objective:ce")
    again, ce = train_step(model, batch)
    assert torch.equal(loss, again)
    assert all(torch.equal(plain[n], ce[n]) for n in plain)


def test_a_mask_and_a_weight_reach_the_objective_as_they_reach_megatrons_loss(deep, batch):
    model = deep(seed=9)
    reference = deepcopy_model(model)
    mask = torch.ones_like(batch.labels, dtype=torch.float)
    mask[0, :6] = 0
    mask[1, 10:] = 0
    mtp_hooks.configure("train=run:0.5+detach+objective:kl")
    mtp_hooks.attach(model)
    model.zero_grad(set_to_none=True)
    model.train()
    with mtp_hooks.mtp_loss_mask(mask):
        model(*batch.args(), labels=batch.labels).sum().backward()
    got = mtp_grads(model)

    reference.train()
    loss, drafts, logits = projections(
        reference, lambda: reference(*batch.args(), labels=batch.labels, loss_mask=mask)
    )
    (loss.sum() + by_hand("kl", drafts, logits, mask, 1.0, 0.5)).backward()
    want = mtp_grads(reference)
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=1e-4, atol=1e-7), name


def test_the_rl_call_derives_its_positions_from_input_ids_as_megatron_does(deep, batch):
    """Megatron-LM's RL loop passes no labels: megatron derives them from ``input_ids`` and
    masks the last position; the objective follows the same positions."""
    model = deep(seed=4)
    reference = deepcopy_model(model)
    mtp_hooks.configure("train=run+detach+objective:tv")
    mtp_hooks.attach(model)
    model.zero_grad(set_to_none=True)
    model.train()
    model(*batch.args()).float().logsumexp(-1).sum().backward()
    got = mtp_grads(model)

    reference.train()
    out, drafts, logits = projections(reference, lambda: reference(*batch.args()))
    derived = torch.ones_like(batch.labels)
    derived[:, -1] = 0  # the label past the window is made up: megatron masks it
    factor = model.config.mtp_loss_scaling_factor
    (
        out.float().logsumexp(-1).sum() + by_hand("tv", drafts, logits, derived, 1.0, factor)
    ).backward()
    want = mtp_grads(reference)
    assert want and all(torch.allclose(got[n], want[n], rtol=1e-4, atol=1e-7) for n in want)


def test_a_forward_without_gradients_adds_nothing_and_leaves_no_hook(deep, batch):
    model = deep(seed=2)
    mtp_hooks.configure("train=run+detach+objective:kl,eval=run+detach+objective:kl")
    mtp_hooks.attach(model)
    model.eval()
    with torch.no_grad():
        model(*batch.args(), labels=batch.labels)
    assert not model.output_layer._forward_hooks
    model.train()
    train_step(model, batch)
    assert not model.output_layer._forward_hooks  # the call's hook went with it


def test_an_interrupted_call_leaves_no_hook_and_the_next_one_trains(deep, batch):
    model = deep(seed=6)
    mtp_hooks.configure("train=run+detach+objective:kl")
    mtp_hooks.attach(model)

    def boom(module, args, output):
        raise RuntimeError("interrupted inside MTP")

    handle = model.mtp.register_forward_hook(boom)
    model.train()
    with pytest.raises(RuntimeError, match="interrupted inside MTP"):
        model(*batch.args(), labels=batch.labels)
    handle.remove()
    assert not model.output_layer._forward_hooks
    _, grads = train_step(model, batch)
    assert all(grads[n] is not None for n in grads if n.startswith("mtp."))


def test_metrics_beside_an_objective_leave_its_gradients_bit_for_bit(deep, batch):
    # +metrics projects each depth itself; the objective's hook on the output layer took those
    # projections for megatron's, and megatron's first depth for the policy's
    grads = {}
    for policy in ("train=run+detach+objective:kl", "train=run+detach+objective:kl+metrics"):
        model = deep(seed=6)
        handle = mtp_hooks.attach(model)
        mtp_hooks.configure(policy)
        _, grads[policy] = train_step(model, batch)
    alone, measured = grads.values()
    assert all(torch.equal(alone[n], measured[n]) for n in alone if n.startswith("mtp."))
    assert handle.metrics()["train"].forwards == 1


def test_metrics_and_an_objective_hear_megatrons_projections_through_one_hook(deep, batch):
    # which of megatron's projections is a depth's and which the policy's is told in one place
    hooks, sampled = [], {}
    for policy in ("train=run+detach+metrics", "train=run+detach+objective:kl+metrics"):
        model = deep(seed=6)
        layer = model.output_layer
        layer.register_forward_pre_hook(lambda m, a: hooks.append(len(m._forward_hooks)))
        handle = mtp_hooks.attach(model)
        mtp_hooks.configure(policy)
        train_step(model, batch)
        sampled[policy] = handle.metrics()["train"].sampled_accepted_length
        assert not layer._forward_hooks
    assert set(hooks) == {1}  # every projection of both calls, with one hook on the layer
    alone, beside = sampled.values()
    assert alone is not None and alone == beside


def test_a_plugins_objective_trains_as_the_same_objective_from_the_config(deep, batch):
    from plugin_answers import answers

    model = deep(seed=8)
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=run+detach+objective:kl")
    _, configured = train_step(model, batch)
    mtp_hooks.configure("train=run+detach")
    answers("mtp_objective", "kl", name="sampler")
    _, chosen = train_step(model, batch)
    assert all(torch.equal(configured[n], chosen[n]) for n in configured)


def by_hand_packed(kind, drafts, policy, mask, cuts, factor):
    """:func:`by_hand` for one row of packed sequences: nothing crosses a boundary in ``cuts``
    (megatron rolls each sequence on its own, and zero-fills its end)."""
    total = torch.zeros((), dtype=torch.float64)
    p_all = torch.softmax(policy.detach().double(), dim=-1)[:, 0]  # [s, v]
    for depth, draft in enumerate(drafts, start=1):
        log_q = torch.log_softmax(draft.double(), dim=-1)[:, 0]
        rolled = torch.zeros(mask.shape[1], dtype=torch.float64)
        per = torch.zeros(mask.shape[1], dtype=torch.float64)
        for start, end in zip(cuts[:-1], cuts[1:], strict=True):
            for i in range(start, end - depth):
                rolled[i] = mask[0, i + depth]
                p = p_all[i + depth]
                if kind == "kl":
                    per[i] = torch.sum(p * (p.log() - log_q[i]))
                else:
                    per[i] = torch.sum((log_q[i].exp() - p).abs()) / 2
        total = total + factor / len(drafts) * torch.sum(rolled * per) / rolled.sum().clamp(min=1)
    return total


@pytest.mark.parametrize("kind", ["kl", "tv"])
def test_under_packed_sequences_no_target_crosses_a_sequence_boundary(kind):
    spec = tiny_models.TinySpec(seq_length=SEQ, vocab_size=128, mtp_num_layers=DEPTHS)
    tiny_models.reset_mtp_loss_tracker(num_layers=DEPTHS)
    models = []
    for _ in range(2):
        torch.manual_seed(14)
        model = tiny_models.build_gpt(spec, attention="sdpa")  # thd-capable on the CPU
        mtp_hooks.megatron.clip_mtp_apart(model)
        models.append(model)
    hooked, reference = models
    row = packed_row()  # two sequences in one row
    ids, pos, mask, cuts, kwargs = (
        row.input_ids,
        row.position_ids,
        row.loss_mask,
        row.cuts,
        row.kwargs(),
    )
    mtp_hooks.configure(f"train=run+detach+objective:{kind}")
    mtp_hooks.attach(hooked)
    hooked.train()
    hooked(ids, pos, None, **kwargs).sum().backward()
    got = mtp_grads(hooked)

    reference.train()
    loss, drafts, logits = projections(reference, lambda: reference(ids, pos, None, **kwargs))
    factor = hooked.config.mtp_loss_scaling_factor  # projections() set the reference's to 0
    (loss.sum() + by_hand_packed(kind, drafts, logits, mask, cuts, factor)).backward()
    want = mtp_grads(reference)
    assert want and all(torch.allclose(got[n], want[n], rtol=1e-4, atol=1e-7) for n in want)

"""``+metrics``' single-position figures: the walks over drafts computed as megatron's inference
engine computes them, each depth on the drafted position alone, on real models.

The reference (tests/engine_reference.py) calls megatron's own ``compute_mtp_single_step``
as the engine calls it for one request, position by position, and walks as the engine walks.
"""

from __future__ import annotations

import pytest
import torch

import mtp_hooks
from mtp_hooks import MTPMetrics, PolicyError
from mtp_hooks.demo import tiny_models
from mtp_hooks.framework import AcceptanceController

from engine_reference import one_request_at_a_time
from model_fixtures import SEQ, VOCAB

DEPTHS = 2


@pytest.fixture
def deep(build):
    return lambda seed=0: build(
        seed, spec=tiny_models.TinySpec(seq_length=SEQ, vocab_size=VOCAB, mtp_num_layers=DEPTHS)
    )


def engine_drafts(model) -> bool:
    """Whether this megatron-core drafts through ``compute_mtp_single_step`` (0.18 on)."""
    return callable(getattr(model, "compute_mtp_single_step", None))


def decoder_hidden(model, batch, labels, loss_mask) -> torch.Tensor:
    """The MTP block's input (the decoder's output) of one eval forward, unrecorded."""
    seen: list[torch.Tensor] = []
    probe = model.mtp.register_forward_hook(lambda m, a, out: seen.append(out.detach()))
    with torch.no_grad():
        model(*batch.args(), labels=labels, loss_mask=loss_mask)
    probe.remove()
    return torch.chunk(seen[0], 1 + DEPTHS, dim=0)[0]


def first_depth_drafts(model, hidden, ids) -> torch.Tensor:
    """``[b, s]``: what the first depth drafts at each position, computed as the engine does."""
    s, b, h = hidden.shape
    out = torch.zeros(b, s, dtype=torch.long)
    for i in range(s - 1):
        for row in range(b):
            _, logits = model.compute_mtp_single_step(
                hidden_states=hidden[i, row].reshape(1, 1, h),
                next_token_ids=ids[row, i + 1].reshape(1, 1),
                position_ids=torch.tensor([[i + 1]]),
                depth=0,
            )
            out[row, i] = logits.reshape(-1).argmax()
    return out


def test_the_single_position_figures_equal_megatrons_engine_drafting_one_request_at_a_time(
    deep, batch
):
    model = deep(seed=5)
    model.eval()
    if not engine_drafts(model):
        pytest.skip("this megatron-core has no compute_mtp_single_step (0.18 on)")
    with torch.no_grad():  # make what the MTP layers' attention brings weigh: context matters
        for name, module in model.mtp.named_modules():
            if name.endswith("linear_proj"):
                module.weight.mul_(30)
    loss_mask = torch.ones_like(batch.labels, dtype=torch.float)
    loss_mask[0, 3:6] = 0  # a gap: the engine's walk starts again after it
    hidden = decoder_hidden(model, batch, batch.labels, loss_mask)
    # labels the single-position first depth drafts right at every other position, so the
    # greedy figures are neither 0 nor the whole chain
    drafts = first_depth_drafts(model, hidden, batch.input_ids)
    labels = batch.labels.clone()
    labels[:, 1::2] = drafts[:, 0 : SEQ - 1 : 2]
    weight = model.output_layer.weight.detach()
    greedy, sampled = one_request_at_a_time(
        model, hidden, batch.input_ids, batch.position_ids, labels, loss_mask, weight
    )
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("eval=run+metrics")
    with torch.no_grad():
        model(*batch.args(), labels=labels, loss_mask=loss_mask)
    got = handle.metrics()["eval"]
    assert got.single_position_accepted_length == pytest.approx(greedy, rel=1e-6)
    assert got.single_position_sampled_accepted_length == pytest.approx(sampled, rel=1e-4)
    assert 0.3 < greedy < DEPTHS
    # training's MTP forward attends over the sequence: another drafter, another figure
    assert got.accepted_length < greedy - 0.2


def test_a_megatron_core_that_drafts_otherwise_reports_no_single_position_figure(deep, batch):
    model = deep()
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("eval=run+metrics")
    model.eval()
    with torch.no_grad():
        model(*batch.args(), labels=batch.labels)
    got = handle.metrics()["eval"]
    if engine_drafts(model):
        assert got.single_position_accepted_length is not None
        assert got.single_position_sampled_accepted_length is not None
    else:  # megatron-core 0.16: its engine drafts with no MTP layer this way
        assert got.single_position_accepted_length is None
        assert got.single_position_sampled_accepted_length is None
    assert got.sampled_accepted_length is not None  # the other figures are there either way


def test_sequence_parallelism_leaves_the_single_position_figures_out(deep, batch):
    model = deep()
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("eval=run+metrics")
    model.eval()
    from mtp_hooks.megatron import _single_position

    model.config.sequence_parallel = True  # read only by the figure's check: TP is 1 here
    try:
        assert not _single_position.supported(model)
    finally:
        model.config.sequence_parallel = False
    with torch.no_grad():
        model(*batch.args(), labels=batch.labels)
    assert handle.metrics()["eval"].accepted_length is not None


def test_the_controller_refuses_to_watch_a_single_position_figure_that_was_not_computed():
    controller = AcceptanceController(
        target=1.0, below=0.3, above=None, metric="single_position_accepted_length"
    )
    counted = MTPMetrics(loss=(), acceptance=(0.5,), tokens=(10,), forwards=1, accepted_length=1.0)
    with pytest.raises(PolicyError, match="single_position_accepted_length.*accepted_length"):
        controller.update(counted)
    assert controller.weight == 0.3  # nothing was decided


def test_the_controller_decides_on_the_single_position_figure(deep, batch):
    controller = AcceptanceController(
        target=0.5, below=0.3, above=None, metric="single_position_sampled_accepted_length"
    )
    figures = MTPMetrics(
        loss=(1.0,),
        acceptance=(0.9,),
        tokens=(10,),
        forwards=1,
        accepted_length=1.8,
        sampled_accepted_length=1.5,
        single_position_accepted_length=0.9,
        single_position_sampled_accepted_length=0.4,
    )
    assert controller.update(figures) == 0.3  # 0.4 < 0.5, though every other figure is above
    assert controller.value == pytest.approx(0.4)

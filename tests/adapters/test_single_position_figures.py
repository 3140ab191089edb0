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
from mtp_hooks_drafting import AcceptanceController

from engine_reference import first_depth_drafts, one_request_at_a_time
from model_fixtures import SEQ, VOCAB, measured_eval, packed_row

DEPTHS = 2


@pytest.fixture
def deep(build):
    return lambda seed=0: build(
        seed, spec=tiny_models.TinySpec(seq_length=SEQ, vocab_size=VOCAB, mtp_num_layers=DEPTHS)
    )


def engine_drafts(model) -> bool:
    """Whether this megatron-core drafts through ``compute_mtp_single_step`` (0.17 on)."""
    return callable(getattr(model, "compute_mtp_single_step", None))


def decoder_hidden(model, batch, labels, loss_mask) -> torch.Tensor:
    """The MTP block's input (the decoder's output) of one eval forward, unrecorded."""
    seen: list[torch.Tensor] = []
    probe = model.mtp.register_forward_hook(lambda m, a, out: seen.append(out.detach()))
    with torch.no_grad():
        model(*batch.args(), labels=labels, loss_mask=loss_mask)
    probe.remove()
    return torch.chunk(seen[0], 1 + DEPTHS, dim=0)[0]


def test_the_single_position_figures_equal_megatrons_engine_drafting_one_request_at_a_time(
    deep, batch
):
    model = deep(seed=5)
    model.eval()
    if not engine_drafts(model):
        pytest.skip("this megatron-core has no compute_mtp_single_step (0.17 on)")
    with torch.no_grad():  # make what the MTP layers' attention brings weigh: context matters
        for name, module in model.mtp.named_modules():
            if name.endswith("linear_proj"):
                module.weight.mul_(30)
    loss_mask = torch.ones_like(batch.labels, dtype=torch.float)
    loss_mask[0, 3:6] = 0  # a gap: the engine's walk starts again after it
    hidden = decoder_hidden(model, batch, batch.labels, loss_mask)
    # labels the single-position first depth drafts right at every other position, so the
    # greedy figures are neither 0 nor the whole chain
    drafts = first_depth_drafts(model, hidden, batch.input_ids, batch.position_ids)
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
    got = measured_eval(model, batch).metrics()["eval"]
    if engine_drafts(model):
        assert got.single_position_accepted_length is not None
        assert got.single_position_sampled_accepted_length is not None
    else:  # megatron-core 0.16: its engine drafts with no MTP layer this way
        assert got.single_position_accepted_length is None
        assert got.single_position_sampled_accepted_length is None
    assert got.sampled_accepted_length is not None  # the other figures are there either way


@pytest.mark.parametrize(
    "setting",
    [
        {"sequence_parallel": True},
        {"context_parallel_size": 2},
        {"fp8": "hybrid"},
        {"fp4": "nvfp4"},
        {"cuda_graph_impl": "local"},
        {"enable_cuda_graph": True},
    ],
    ids=lambda setting: next(iter(setting)),
)
def test_a_setting_an_extra_mtp_forward_would_disturb_leaves_the_figures_out(deep, setting):
    from mtp_hooks.megatron.drafting import _single_position

    model = deep()
    if not engine_drafts(model):
        pytest.skip("this megatron-core has no compute_mtp_single_step (0.17 on)")
    assert _single_position.supported(model)
    before = {name: getattr(model.config, name, None) for name in setting}
    try:
        for name, value in setting.items():  # read by the check only: nothing runs
            object.__setattr__(model.config, name, value)
        assert not _single_position.supported(model)
    finally:
        for name, value in before.items():
            object.__setattr__(model.config, name, value)


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


def test_under_packed_sequences_each_sequence_is_drafted_and_walked_on_its_own():
    spec = tiny_models.TinySpec(seq_length=SEQ, vocab_size=VOCAB, mtp_num_layers=DEPTHS)
    torch.manual_seed(14)
    model = tiny_models.build_gpt(spec, attention="sdpa")  # thd-capable on the CPU
    model.eval()
    if not engine_drafts(model):
        pytest.skip("this megatron-core has no compute_mtp_single_step (0.17 on)")
    row = packed_row()  # two sequences in one row, the first with a masked-out prompt
    kwargs = row.kwargs()
    seen: list[torch.Tensor] = []
    probe = model.mtp.register_forward_hook(lambda m, a, out: seen.append(out.detach()))
    with torch.no_grad():
        model(row.input_ids, row.position_ids, None, **kwargs)
    probe.remove()
    hidden = torch.chunk(seen[0], 1 + DEPTHS, dim=0)[0]  # [t, 1, h]
    # the reference: the two sequences as two requests, padded with masked-out positions
    (start, cut, end), width = row.cuts, max(row.cuts[1], SEQ - row.cuts[1])

    def two(t: torch.Tensor) -> torch.Tensor:  # [1, t] -> [2, width], zero-padded
        out = torch.zeros(2, width, dtype=t.dtype)
        out[0, : cut - start], out[1, : end - cut] = t[0, start:cut], t[0, cut:end]
        return out

    padded = torch.zeros(width, 2, hidden.shape[-1])
    padded[: cut - start, 0], padded[: end - cut, 1] = hidden[start:cut, 0], hidden[cut:end, 0]
    # labels that the single-position first depth drafts right wherever it drafts inside a
    # sequence, so the greedy figure is not 0
    drafts = first_depth_drafts(model, hidden, row.input_ids, row.position_ids)
    labels = kwargs["labels"] = kwargs["labels"].clone()
    for a, b in ((start, cut), (cut, end)):
        labels[0, a + 1 : b] = drafts[0, a : b - 1]
    greedy, sampled = one_request_at_a_time(
        model,
        padded,
        two(row.input_ids),
        two(row.position_ids),
        two(labels),
        two(row.loss_mask),
        model.output_layer.weight.detach(),
    )
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("eval=run+metrics")
    with torch.no_grad():
        model(row.input_ids, row.position_ids, None, **kwargs)
    got = handle.metrics()["eval"]
    assert got.single_position_accepted_length == pytest.approx(greedy, rel=1e-6)
    assert got.single_position_sampled_accepted_length == pytest.approx(sampled, rel=1e-4)
    assert greedy > 0.5

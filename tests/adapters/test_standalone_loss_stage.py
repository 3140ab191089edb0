"""The loss stage of a layout whose MTP has a pipeline stage of its own, in one process.

The stage is a GPTModel without ``pre_process`` and without an MTP block, whose config says
``mtp_standalone`` (the config of every stage of such a layout does); what the MTP stage would
have sent is handed in with ``set_input_tensor``, as megatron's schedules do. Both stages on two
ranks: tests/distributed/test_standalone_mtp_stage.py.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

import mtp_hooks  # noqa: E402
from mtp_hooks.demo import tiny_models  # noqa: E402

from model_fixtures import SEQ, VOCAB  # noqa: E402


@pytest.fixture(params=[False, True], ids=["untied", "tied"])
def stage(request):
    torch.manual_seed(0)
    spec = tiny_models.TinySpec(seq_length=SEQ, vocab_size=VOCAB)
    model = tiny_models.build_gpt(
        spec,
        attention="sdpa",
        pre_process=False,
        with_mtp_block=False,
        share_embeddings=request.param,  # no MTP block here, so no tied-weight hazard either
    )
    model.config = copy.copy(model.config)
    model.config.mtp_standalone = True
    assert not model.mtp_process and model.config.mtp_num_layers == 1
    return model


def received(model, rows: int) -> torch.Tensor:
    hidden = torch.randn(
        rows, 2, model.config.hidden_size, generator=torch.Generator().manual_seed(5)
    )
    model.set_input_tensor(hidden)
    return hidden


def test_the_loss_stage_computes_mtp_losses_only_for_microbatches_the_mtp_stage_ran(stage, batch):
    handle = mtp_hooks.attach(stage)
    mtp_hooks.configure("train=run")
    config = stage.config
    for rows, recorded in ((2 * SEQ, True), (SEQ, False)):
        tiny_models.reset_mtp_loss_tracker()
        received(stage, rows)
        loss = stage(*batch.args(), labels=batch.labels)
        assert loss.shape == (2, SEQ)
        assert (tiny_models.recorded_mtp_loss() > 0) is recorded
        assert stage.config is config  # the skip's view is gone after the call
    assert handle.stats() == {"train": {"run": 1, "skip": 1}}


def test_a_row_count_that_fits_no_decision_is_refused_with_the_counts(stage, batch):
    handle = mtp_hooks.attach(stage)
    config = stage.config
    received(stage, 3 * SEQ)
    with pytest.raises(mtp_hooks.UnsupportedModelError) as info:
        stage(*batch.args(), labels=batch.labels)
    assert f"received {3 * SEQ} rows" in str(info.value) and f"({2 * SEQ})" in str(info.value)
    assert stage.config is config and handle.gates[0].records == []


def test_a_loss_stage_called_without_the_previous_stages_output_is_refused(stage, batch):
    mtp_hooks.attach(stage)
    stage.set_input_tensor(None)
    with pytest.raises(mtp_hooks.UnsupportedModelError, match="set_input_tensor"):
        stage(*batch.args(), labels=batch.labels)


def test_a_stage_without_mtp_in_an_ordinary_layout_is_not_gated(stage):
    stage.config.mtp_standalone = False
    assert mtp_hooks.attach(stage).gates == []

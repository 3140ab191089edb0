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
from plugin_answers import answers  # noqa: E402


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


def test_metrics_and_a_self_distilling_objective_are_refused_at_attach_naming_the_phase(stage):
    config = stage.config
    mtp_hooks.configure("train=run,eval=run+metrics")
    with pytest.raises(mtp_hooks.UnsupportedModelError) as metrics:
        mtp_hooks.attach(stage)
    assert "the policy config asks '+metrics' in eval" in str(metrics.value)
    assert "mtp_standalone" in str(metrics.value) and metrics.value.option == "+metrics"
    if "mtp_detach_heads" not in type(stage.config).__dataclass_fields__:
        pytest.skip("+detach, which +objective:kl needs, needs megatron-core 0.19")
    mtp_hooks.configure("train=run+detach+objective:kl")
    with pytest.raises(mtp_hooks.UnsupportedModelError) as objective:
        mtp_hooks.attach(stage)
    assert "the policy config asks '+objective' in train" in str(objective.value)
    assert "Put MTP on the last stage, or use objective 'ce'" in str(objective.value)
    assert stage.config is config and not stage._forward_pre_hooks
    mtp_hooks.configure("train=run+detach+objective:ce")  # megatron's own loss: no target
    mtp_hooks.attach(stage).remove()


def test_a_self_distilling_objective_from_plugins_is_refused_at_the_forward_naming_them(
    stage, batch
):
    if "mtp_detach_heads" not in type(stage.config).__dataclass_fields__:
        pytest.skip("+detach, which +objective:kl needs, needs megatron-core 0.19")
    answers("mtp_detach_heads", True, name="detacher")
    answers("mtp_objective", "kl", name="distiller")
    handle = mtp_hooks.attach(stage)  # nothing configured: the plugins answer at the forward
    config = stage.config
    received(stage, 2 * SEQ)
    with pytest.raises(mtp_hooks.UnsupportedModelError) as refused:
        stage(*batch.args(), labels=batch.labels)
    assert "plugin(s) distiller asks '+objective' in train" in str(refused.value)
    assert stage.config is config and handle.gates[0].records == []

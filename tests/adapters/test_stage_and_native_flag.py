"""The tied-embedding pipeline stage, and models with the native ``compute_mtp_loss`` flag."""

from __future__ import annotations

import pytest
import torch

import mtp_hooks
from mtp_hooks.demo import tiny_models

from model_fixtures import KINDS, has_detach_field, native


def mtp_stage(build):
    """The last pipeline stage with MTP: no pre_process, tied embeddings (docs/hazards.md, 6)."""
    model = build(pre_process=False, share_embeddings=True)
    assert model.mtp_process and not model.pre_process
    return model


def stage_input(model, batch):
    torch.manual_seed(7)
    model.set_input_tensor(torch.randn(batch.input_ids.shape[1], batch.input_ids.shape[0], 64))


def test_the_gate_toggle_would_switch_a_tied_stage_to_another_weight(build):
    model = mtp_stage(build)
    with_mtp = model.shared_embedding_or_output_weight()
    model.mtp_process = False
    try:
        assert model.shared_embedding_or_output_weight() is not with_mtp
    finally:
        model.mtp_process = True


def test_skipping_on_a_tied_stage_without_the_native_flag_is_refused(build, batch):
    model = mtp_stage(build)
    config = model.config
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip")
    stage_input(model, batch)
    with pytest.raises(
        mtp_hooks.UnsupportedModelError, match="share_embeddings_and_output_weights"
    ):
        model(*batch.args(), labels=batch.labels)
    assert model.mtp_process is True and model.config is config


def test_running_on_a_tied_stage_is_unchanged(build, batch):
    plain, hooked = mtp_stage(build), None
    torch.manual_seed(0)
    hooked = build(pre_process=False, share_embeddings=True)
    hooked.load_state_dict(plain.state_dict())
    mtp_hooks.attach(hooked)
    mtp_hooks.configure("train=run")
    stage_input(plain, batch)
    expected = plain(*batch.args(), labels=batch.labels)
    stage_input(hooked, batch)
    assert torch.equal(hooked(*batch.args(), labels=batch.labels), expected)


def test_an_untied_mtp_stage_without_pre_process_can_skip(build, batch, count_mtp):
    model = build(pre_process=False, share_embeddings=False)
    counter = count_mtp(model)
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip")
    stage_input(model, batch)
    model(*batch.args(), labels=batch.labels)
    assert counter.n == 0 and tiny_models.recorded_mtp_loss() == 0.0


def test_a_native_flag_model_gets_the_kwarg_keeps_mtp_process_and_sees_no_mtp_heads(
    build, kind, batch, count_mtp
):
    model = build(model_cls=native(kind))
    counter = count_mtp(model)
    shared = model.config
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip")
    model(*batch.args(), labels=batch.labels)
    ((flag, mtp_process, config),) = model.received
    assert (flag, mtp_process) == (False, True)  # mtp_process kept: the tied stage needs it
    assert config is not shared and config.mtp_num_layers is None  # what ModelOpt counts
    assert counter.n == 0 and model.config is shared and shared.mtp_num_layers == 1


def test_a_native_flag_model_gets_no_kwarg_on_a_run_decision(build, kind, batch):
    model = build(model_cls=native(kind))
    mtp_hooks.attach(model)
    model(*batch.args(), labels=batch.labels)
    assert model.received == [(True, True, model.config)]


def test_the_native_flag_is_used_even_on_a_tied_stage(kind, build, batch):
    model = build(model_cls=native(kind), pre_process=False, share_embeddings=True)
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip")
    stage_input(model, batch)
    model(*batch.args(), labels=batch.labels)
    assert [r[:2] for r in model.received] == [(False, True)]


# Megatron-LM main's keyword is HybridModel's; the emulation on a released GPTModel cannot
# turn MTP off from inside forward (its loss code still runs), so these take the hybrid only.
HYBRID = [k for k in KINDS if k != "gpt"]


@pytest.mark.parametrize("kind", HYBRID)
def test_a_callers_own_compute_mtp_loss_false_wins_over_a_run_and_counts_as_untouched(
    build, kind, batch, count_mtp
):
    model = build(model_cls=native(kind))
    counter = count_mtp(model)
    handle = mtp_hooks.attach(model)
    model(*batch.args(), labels=batch.labels, compute_mtp_loss=False)
    assert model.received == [(False, True, model.config)]
    assert counter.n == 0
    assert handle.stats() == {"train": {"untouched": 1}}


@pytest.mark.parametrize("kind", HYBRID)
def test_a_callers_own_compute_mtp_loss_false_under_a_skip_is_skipped_as_planned(
    build, kind, batch, count_mtp
):
    model = build(model_cls=native(kind))
    counter = count_mtp(model)
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip")
    model(*batch.args(), labels=batch.labels, compute_mtp_loss=False)
    ((flag, mtp_process, config),) = model.received
    assert (flag, mtp_process) == (False, True) and config.mtp_num_layers is None
    assert counter.n == 0
    assert handle.stats() == {"train": {"skip": 1}}


@pytest.mark.parametrize("kind", HYBRID)
@pytest.mark.parametrize(
    ("policy", "phase", "named"),
    [
        ("eval=run+metrics", "eval", "+metrics"),
        ("train=run:0.5", "train", "a loss weight"),
        ("train=run+mask:labels", "train", "+mask:labels"),
    ],
)
def test_a_callers_own_compute_mtp_loss_false_against_more_than_a_run_is_refused_before_the_forward(
    build, kind, batch, policy, phase, named
):
    model = build(model_cls=native(kind))
    model.train(phase == "train")
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure(policy)
    with pytest.raises(mtp_hooks.PolicyConflictError, match="compute_mtp_loss=False") as err:
        model(*batch.args(), labels=batch.labels, compute_mtp_loss=False)
    assert named in str(err.value) and f"{phase}=skip" in str(err.value)
    assert "received" not in model.__dict__  # refused before megatron's forward began
    assert not model.mtp._forward_hooks and not model.output_layer._forward_hooks
    assert handle.stats() == {}
    mtp_hooks.configure(f"{phase}=run")  # the same call with a plain run goes through
    model(*batch.args(), labels=batch.labels, compute_mtp_loss=False)
    assert model.received == [(False, True, model.config)]


@pytest.mark.skipif(not has_detach_field(), reason="+objective needs megatron-core 0.19's +detach")
@pytest.mark.parametrize("kind", HYBRID)
def test_a_callers_own_compute_mtp_loss_false_against_an_objective_is_refused_not_left_untrained(
    build, kind, batch
):
    model = build(model_cls=native(kind))
    mtp_hooks.megatron.clip_mtp_apart(model)
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=run+detach+objective:kl")
    with pytest.raises(mtp_hooks.PolicyConflictError, match=r"with \+detach and \+objective\."):
        model(*batch.args(), labels=batch.labels, compute_mtp_loss=False)
    assert "received" not in model.__dict__
    assert not model.output_layer._forward_hooks  # no objective call left open


def test_a_policy_skipping_any_phase_on_a_tied_stage_is_refused_at_attach_and_first_forward(
    build, batch, count_mtp
):
    model = mtp_stage(build)
    mtp_hooks.configure("train=run,eval=skip")
    with pytest.raises(mtp_hooks.UnsupportedModelError, match=r"\(eval=skip\)"):
        mtp_hooks.attach(model)
    assert not model._forward_pre_hooks and not model._forward_hooks
    mtp_hooks.configure("train=run")
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=run,rollout=skip")
    ran = count_mtp(model)
    stage_input(model, batch)
    with pytest.raises(mtp_hooks.UnsupportedModelError, match=r"\(rollout=skip\)"):
        model(*batch.args(), labels=batch.labels)  # a training forward: refused before it runs
    assert ran.n == 0 and model.mtp_process is True

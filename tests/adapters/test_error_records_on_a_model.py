"""An error met at attach or in a forward of a real model names its culprit in its record
(``phase``, ``role``, ``option``, ``plugin``, ``hook``), as the user guide promises of every
error: ``None`` only where one does not apply. A role's refusal names the role; a plugin's
failure in a forward names the plugin, its hook, and the phase and role of the call."""

from __future__ import annotations

import copy

import pytest
import torch

import mtp_hooks

from model_fixtures import guards_empty_masks, has_detach_field, native
from plugin_answers import answers


def test_a_roles_training_skip_under_ep_overlap_is_refused_naming_the_role(build):
    model = build()
    model.config = copy.copy(model.config)
    model.config.overlap_moe_expert_parallel_comm = True
    mtp_hooks.configure("teacher.train=skip")
    with pytest.raises(mtp_hooks.UnsupportedModelError) as info:
        mtp_hooks.attach(model, role="teacher")
    assert (info.value.role, info.value.phase, info.value.option) == ("teacher", "train", "skip")
    assert not model._forward_pre_hooks


@pytest.mark.skipif(not has_detach_field(), reason="+detach needs megatron-core 0.19")
def test_a_roles_detach_without_clip_mtp_apart_is_refused_naming_the_role(build):
    model = build()  # its MTP weights in no gradient-norm group of their own
    mtp_hooks.configure("teacher.train=run+detach")
    with pytest.raises(mtp_hooks.UnsupportedModelError, match="clip_mtp_apart") as info:
        mtp_hooks.attach(model, role="teacher")
    assert (info.value.role, info.value.phase, info.value.option) == ("teacher", "train", "+detach")


def test_a_callers_own_compute_mtp_loss_false_on_a_role_is_refused_naming_the_role(
    build, kind, batch
):
    model = build(model_cls=native(kind))
    model.eval()
    mtp_hooks.attach(model, role="teacher")
    mtp_hooks.configure("teacher.eval=run+metrics")
    with pytest.raises(mtp_hooks.PolicyConflictError, match="compute_mtp_loss=False") as info:
        model(*batch.args(), labels=batch.labels, compute_mtp_loss=False)
    assert (info.value.role, info.value.phase, info.value.option) == ("teacher", "eval", "+metrics")


needs_masks = pytest.mark.skipif(
    not guards_empty_masks(), reason="this megatron-core refuses per-call masks (0.18 on)"
)


def record(error: mtp_hooks.MTPHooksError) -> tuple:
    return (error.phase, error.role, error.plugin, error.hook)


@needs_masks
def test_a_mask_plugin_that_raises_is_named_with_the_phase_and_role_of_the_call(build, batch):
    model = build()
    mtp_hooks.attach(model, role="teacher")
    answers("mtp_loss_mask", RuntimeError("no batch"), name="masker")
    model.train()
    with pytest.raises(mtp_hooks.PluginError, match="'masker': mtp_loss_mask raised") as info:
        model(*batch.args(), labels=batch.labels)
    assert record(info.value) == ("train", "teacher", "masker", "mtp_loss_mask")


@needs_masks
def test_a_plugins_mask_of_the_wrong_shape_is_named_with_its_plugin_and_hook(build, batch):
    model = build()
    mtp_hooks.attach(model, role="teacher")
    answers("mtp_loss_mask", torch.ones(3), name="masker")
    model.train()
    with pytest.raises(mtp_hooks.PolicyError, match="plugin 'masker'") as info:
        model(*batch.args(), labels=batch.labels)
    assert record(info.value) == ("train", "teacher", "masker", "mtp_loss_mask")


def test_a_metrics_plugin_that_raises_is_named_with_the_phase_and_role_of_the_call(build, batch):
    model = build()
    mtp_hooks.attach(model, role="teacher")
    mtp_hooks.configure("eval=run+metrics")
    answers("mtp_metrics", RuntimeError("no writer"), name="listener")
    model.eval()
    with torch.no_grad(), pytest.raises(mtp_hooks.PluginError, match="'listener'") as info:
        model(*batch.args(), labels=batch.labels)
    assert record(info.value) == ("eval", "teacher", "listener", "mtp_metrics")

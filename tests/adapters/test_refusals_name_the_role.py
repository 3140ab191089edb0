"""A refusal of a role's own policy entry names that role in its record (``error.role``), as
the user guide promises of every error: ``None`` only where no role applies."""

from __future__ import annotations

import copy

import pytest

import mtp_hooks

from model_fixtures import has_detach_field, native


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

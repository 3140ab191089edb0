"""Megatron's combined 1F1B schedule (``overlap_moe_expert_parallel_comm=True``), on a CPU.

There megatron builds every training microbatch through ``build_schedule_plan``, which calls no
forward hook, so training runs MTP plainly whatever the policy says. The schedule itself needs
CUDA streams and expert parallelism; what decides whether a policy is honest there is the
gate's check, which these tests drive as megatron's training does: at attach, before the first
step, and at the next forward after the policy changes. Every plan option is refused there,
because the check reads the one list of them (``_phase_plan.OPTIONS``).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import mtp_hooks
from mtp_hooks.megatron import _phase_plan

from plugin_answers import answers


def overlapped(model):
    """``model`` with a config of its own that runs the combined 1F1B / EP-overlap schedule in
    training (which only an expert-parallel GPU job can run; the gate reads the config)."""
    model.config = copy.copy(model.config)
    model.config.overlap_moe_expert_parallel_comm = True
    return model


def test_under_ep_overlap_mtp_in_training_and_not_in_evaluation_works(build, batch, count_mtp):
    model = overlapped(build())
    counter = count_mtp(model)
    mtp_hooks.configure("train=run,eval=skip")
    handle = mtp_hooks.attach(model)
    model(*batch.args(), labels=batch.labels)
    model.eval()
    with torch.no_grad():  # a forward-only pass: megatron calls the model itself
        model(*batch.args(), labels=batch.labels)
    assert counter.n == 1 and handle.stats() == {"train": {"run": 1}, "eval": {"skip": 1}}


@pytest.mark.parametrize(
    ("train", "named"),
    [
        ("skip", "is skip"),
        ("run:0.3", "a loss weight"),
        ("run+metrics", "+metrics"),
        ("run+detach", "+detach"),
        ("run+mask:labels", "+mask:labels"),
        ("run+detach+objective:kl", "+objective"),
    ],
)
def test_under_ep_overlap_anything_but_a_plain_training_run_is_refused_at_attach(
    build, train, named
):
    model = overlapped(build())
    config = model.config
    mtp_hooks.configure(f"train={train},eval=skip")
    with pytest.raises(mtp_hooks.UnsupportedModelError) as info:
        mtp_hooks.attach(model)
    message = str(info.value)
    assert named in message and "overlap_moe_expert_parallel_comm" in message
    assert info.value.phase == "train" and f"is {info.value.option}" in message
    assert "build_schedule_plan" in message and "train=run, eval=skip works" in message
    assert model.config is config and not model._forward_pre_hooks


def test_under_ep_overlap_a_plugins_loss_mask_is_refused_at_attach(build):
    model = overlapped(build())
    answers("mtp_loss_mask", None, name="masks")
    mtp_hooks.configure("train=run,eval=skip")
    with pytest.raises(mtp_hooks.UnsupportedModelError, match="mtp_loss_mask answers"):
        mtp_hooks.attach(model)
    mtp_hooks.configure({"train": {"mtp": "run", "plugin_masks": False}, "eval": "skip"})
    mtp_hooks.attach(model)  # the plugin's masks turned off: a plain run again


@pytest.mark.parametrize(
    ("later", "named"), [("run+mask:labels", r"\+mask:labels"), ("skip", "is skip")]
)
def test_under_ep_overlap_a_later_training_option_or_skip_is_refused_at_the_next_forward(
    build, batch, later, named
):
    model = overlapped(build())
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=run,eval=skip")
    model(*batch.args(), labels=batch.labels)
    mtp_hooks.configure(f"train={later},eval=skip")
    model.eval()
    with torch.no_grad(), pytest.raises(mtp_hooks.UnsupportedModelError, match=named) as info:
        model(*batch.args(), labels=batch.labels)
    assert model.mtp_process is True
    assert info.value.phase == "train"


def test_every_field_of_a_plan_is_an_option_derived_from_one_or_bookkeeping():
    # an option added to PhasePlan without a declaration would slip past the check above
    declared = [o.field for o in _phase_plan.OPTIONS]
    declared += [*_phase_plan.DERIVED, *_phase_plan.BOOKKEEPING]
    fields = [f.name for f in dataclasses.fields(_phase_plan.PhasePlan)]
    assert sorted(declared) == sorted(fields)


def test_a_plain_plan_asks_for_no_option_and_each_option_is_named():
    plain = _phase_plan.PhasePlan(
        phase="train", generation=0, run=True, counters=[], loss_scale=None, metrics=False,
        detach=False, changes=None, masks=False, ignore_index=None, masking=False,
    )  # fmt: skip
    assert plain.options() == [] and plain.plainly(False).run is False
    for option in _phase_plan.OPTIONS:
        value = {None: 0.5, False: True}[option.plain] if option.plain in (None, False) else 1
        asked = dataclasses.replace(plain, **{option.field: value})
        assert asked.options() == [option.says]
        assert asked.plainly(True).options() == []

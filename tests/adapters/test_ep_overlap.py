"""Megatron's combined 1F1B schedule (``overlap_moe_expert_parallel_comm=True``), on a CPU.

There megatron builds every training microbatch through ``build_schedule_plan``, which calls no
forward hook, so training runs MTP plainly whatever the policy says. The schedule itself needs
CUDA streams and expert parallelism; what decides whether a policy is honest there is the
gate's check, which these tests drive as megatron's training does: at attach, before the first
step, and at the next forward after the policy changes. Every plan option is refused there,
because the check asks every policy option what a plan asks of it (``_options.OPTIONS``).
"""

from __future__ import annotations

import copy

import pytest
import torch

import mtp_hooks
from mtp_hooks import _options
from mtp_hooks._decision import Decision
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


ASKING = {  # each option set away from its plain value, as a decision would set it
    "loss_scale": {"loss_scale": 0.5},
    "metrics": {"metrics": True},
    "detach": {"detach": True},
    "mask": {"mask": "labels"},
    "objective": {"objective": "kl", "detach": True},
}


def test_every_option_set_in_a_decision_is_asked_by_its_plan_and_named():
    # an option whose plan asks nothing would slip past the check above
    assert set(ASKING) == {option.name for option in _options.OPTIONS}
    plain = _options.plain()
    made = _phase_plan._made("train", 0, [], Decision(run=True, kind="config", options=plain))
    assert made.asked() == [] and made.plainly(False).run is False
    for name, fields in ASKING.items():
        options = plain.with_fields(fields, name, "config")
        made = _phase_plan._made("train", 0, [], Decision(run=True, kind="config", options=options))
        assert made.asked(), name
        assert made.plainly(True).asked() == []
        skipped = Decision(run=False, kind="config", options=options)
        assert _phase_plan._made("train", 0, [], skipped).asked() == []

"""Inference is left alone; gates are restored after errors; nested forwards restore in order."""

from __future__ import annotations

import pytest
import torch

import mtp_hooks
from mtp_hooks.demo import tiny_models


def static_context(batch):
    try:
        from megatron.core.inference.contexts import StaticInferenceContext
    except ImportError:
        pytest.skip("this megatron-core has no StaticInferenceContext")
    return StaticInferenceContext(batch.input_ids.shape[0], batch.input_ids.shape[1])


def test_under_inference_mode_the_hook_is_never_consulted(build, batch, voter):
    try:
        from megatron.core.inference.utils import InferenceMode
    except ImportError:
        pytest.skip("InferenceMode exists from megatron-core 0.18")
    model = build()
    handle = mtp_hooks.attach(model)
    counting = voter(False, "counting")
    model.eval()
    with torch.no_grad(), InferenceMode.active(), mtp_hooks.phase("rollout"):
        try:
            model(*batch.args(), runtime_gather_output=True)
        except Exception:  # a CPU inference pass may fail later; only the hook matters here
            pass
    assert counting.calls == []
    assert handle.stats() == {"inference": {"untouched": 1}}


@pytest.mark.parametrize("how", ["keyword", "positional", "inference_params"])
def test_with_an_inference_context_the_hook_is_never_consulted(build, batch, voter, how):
    model = build()
    handle = mtp_hooks.attach(model)
    counting = voter(False, "counting")
    context = static_context(batch)
    mp, config = model.mtp_process, model.config
    seen = []
    model.decoder.register_forward_pre_hook(
        lambda m, a: seen.append((model.mtp_process, model.config))
    )
    model.eval()
    with torch.no_grad(), mtp_hooks.phase("rollout"):
        try:
            if how == "keyword":
                model(*batch.args(), inference_context=context)
            elif how == "positional":
                model(*batch.args(), None, None, context)
            else:
                model(*batch.args(), inference_params=context)
        except Exception:  # a CPU inference pass may fail later; only the hook matters here
            pass
    assert counting.calls == []
    assert handle.stats() == {"inference": {"untouched": 1}}
    assert all(m is mp and c is config for m, c in seen)


def test_an_exception_inside_forward_restores_the_very_same_gate_objects(build, batch):
    model = build()
    mtp_process, config = model.mtp_process, model.config
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip")
    with pytest.raises(RuntimeError):
        model(batch.input_ids[:, :3], batch.position_ids, batch.attention_mask, labels=batch.labels)
    assert model.mtp_process is mtp_process and model.config is config


@pytest.mark.parametrize("policy, counted", [("train=run", "run"), ("train=skip", "skip")])
def test_stats_count_the_decision_of_a_forward_that_raised(build, batch, policy, counted):
    model = build()
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure(policy)
    with pytest.raises(RuntimeError):
        model(batch.input_ids[:, :3], batch.position_ids, batch.attention_mask, labels=batch.labels)
    assert handle.stats() == {"train": {counted: 1}}  # as AttachHandle.stats() documents


def test_the_forward_after_an_exception_is_normal(build, batch, count_mtp):
    model = build()
    counter = count_mtp(model)
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip")
    with pytest.raises(RuntimeError):
        model(batch.input_ids[:, :3], batch.position_ids, batch.attention_mask, labels=batch.labels)
    mtp_hooks.configure("train=run")
    model(*batch.args(), labels=batch.labels).sum().backward()
    assert counter.n == 1 and tiny_models.recorded_mtp_loss() > 0


def test_a_policy_error_at_forward_time_changes_nothing(build, batch, voter):
    model = build()
    mtp_process, config = model.mtp_process, model.config
    mtp_hooks.attach(model)
    voter(True, "a")
    voter(False, "b")
    with pytest.raises(mtp_hooks.PolicyConflictError):
        model(*batch.args(), labels=batch.labels)
    assert model.mtp_process is mtp_process and model.config is config


def test_a_teacher_nested_in_a_student_forward_gets_its_own_decision(build, batch, count_mtp):
    student, teacher = build(seed=1), build(seed=2)
    s_count, t_count = count_mtp(student), count_mtp(teacher)
    s_cfg, t_cfg = student.config, teacher.config
    mtp_hooks.attach(student, role="student")
    mtp_hooks.attach(teacher, role="teacher")
    mtp_hooks.configure("train=run,teacher.train=skip")
    inside = []

    def run_teacher(module, args):
        # as ModelOpt's DistillationModel does: the teacher runs inside the student's forward
        teacher.train()
        teacher(*batch.args(), labels=batch.labels)
        inside.append((student.mtp_process, student.config is s_cfg))

    student.decoder.register_forward_pre_hook(run_teacher)
    student(*batch.args(), labels=batch.labels).sum().backward()
    assert (t_count.n, s_count.n) == (0, 1)
    assert inside == [(True, True)]
    assert teacher.config is t_cfg and teacher.mtp_process is True
    assert student.config is s_cfg and student.mtp_process is True


def test_a_reentrant_forward_of_the_same_model_restores_each_level(build, batch, count_mtp):
    model = build()
    counter = count_mtp(model)
    shared = model.config
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=run,rollout=skip")
    states = []

    def reenter(module, args):
        if len(states) == 0:
            states.append(("outer", model.mtp_process, model.config is shared))
            with mtp_hooks.phase("train"):
                model(*batch.args(), labels=batch.labels)
            states.append(("after inner", model.mtp_process, model.config is shared))

    model.decoder.register_forward_pre_hook(reenter)
    with mtp_hooks.phase("rollout"):
        model(*batch.args(), labels=batch.labels)
    assert states == [("outer", False, False), ("after inner", False, False)]
    assert counter.n == 1  # only the inner, run-decided forward ran MTP
    assert model.mtp_process is True and model.config is shared


def test_checkpoints_are_identical_before_after_skips_and_after_remove(build, batch):
    model = build()

    def snapshot():
        sd = {k: v.clone() if torch.is_tensor(v) else v for k, v in model.state_dict().items()}
        return sd, sorted(model.sharded_state_dict().keys())

    before, sharded_before = snapshot()
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip,eval=skip")
    with torch.no_grad():
        model(*batch.args(), labels=batch.labels)
    during, sharded_during = snapshot()
    handle.remove()
    after, sharded_after = snapshot()
    assert any(k.startswith("mtp.") for k in before)
    for state in (during, after):
        assert state.keys() == before.keys()
        assert all(
            torch.equal(state[k], before[k]) if torch.is_tensor(before[k]) else True for k in before
        )
    assert sharded_before == sharded_during == sharded_after

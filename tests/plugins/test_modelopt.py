"""mtp-hooks-modelopt: freeze_mtp skips MTP for teacher and student, weights kept and frozen."""

from __future__ import annotations

import pytest
import torch

import mtp_hooks
import mtp_hooks_modelopt
from mtp_hooks.demo import tiny_models


@pytest.fixture
def pair(build, only):
    only("modelopt")
    student, teacher = build(seed=1), build(seed=2)
    ran = {"student": tiny_models.MTPForwards(student), "teacher": tiny_models.MTPForwards(teacher)}
    return student, teacher, ran


def distill_forward(student, teacher, batch):
    """As ModelOpt's DistillationModel: the teacher runs, in eval and no_grad, inside the
    student's forward call; then the student's own forward goes on."""

    def run_teacher(module, args):
        teacher.eval()
        with torch.no_grad():
            teacher(*batch.args(), labels=batch.labels)

    hook = student.decoder.register_forward_pre_hook(run_teacher)
    try:
        return student(*batch.args(), labels=batch.labels)
    finally:
        hook.remove()


def test_freeze_mtp_skips_teacher_and_student_in_a_nested_forward(pair, batch):
    student, teacher, counts = pair
    s_cfg, t_cfg = student.config, teacher.config
    mtp_hooks_modelopt.prepare_distillation(student, teacher, freeze_mtp=True)
    distill_forward(student, teacher, batch).sum().backward()
    assert (counts["student"].n, counts["teacher"].n) == (0, 0)
    assert tiny_models.recorded_mtp_loss() == 0.0
    assert student.config is s_cfg and teacher.config is t_cfg
    assert student.mtp_process and teacher.mtp_process


def test_freeze_mtp_keeps_the_student_mtp_weights_bit_identical_across_steps(pair, batch):
    student, teacher, _ = pair
    mtp_hooks_modelopt.prepare_distillation(student, teacher, freeze_mtp=True)
    before = {
        k: v.clone()
        for k, v in student.state_dict().items()
        if k.startswith("mtp.") and torch.is_tensor(v)
    }
    optimizer = torch.optim.AdamW(
        [p for p in student.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1
    )
    for _ in range(3):
        optimizer.zero_grad()
        distill_forward(student, teacher, batch).sum().backward()
        optimizer.step()
    after = student.state_dict()
    assert before and all(torch.equal(before[k], after[k]) for k in before)


def test_without_freeze_the_plugin_abstains_and_mtp_runs(pair, batch):
    student, teacher, counts = pair
    mtp_hooks_modelopt.prepare_distillation(student, teacher, freeze_mtp=False)
    distill_forward(student, teacher, batch).sum().backward()
    assert (counts["student"].n, counts["teacher"].n) == (1, 1)
    assert mtp_hooks.decide(student, "train").votes["modelopt"] is None


def test_models_without_a_distillation_role_are_not_affected(build, batch, only):
    only("modelopt")
    other = build()
    mtp_hooks.attach(other)
    mtp_hooks_modelopt.configure(freeze_mtp=True)
    assert mtp_hooks.decide(other, "train").decided_by == "default"


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((), {}, "missing key 'freeze_mtp'"),
        (({"freeze_mtp": "true"},), {}, "key 'freeze_mtp' must be bool"),
        (({"freeze_mtp": True},), {"freeze_mtp": True}, "either in the config or as keyword"),
    ],
)
def test_bad_modelopt_config_names_the_key(args, kwargs, message):
    with pytest.raises(mtp_hooks.PolicyError, match=message):
        mtp_hooks_modelopt.configure(*args, **kwargs)
    assert mtp_hooks_modelopt.current() is None

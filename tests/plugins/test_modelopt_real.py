"""mtp-hooks-modelopt inside ModelOpt's real distillation model (nvidia-modelopt 0.47.0).

``adjust_distillation_model_for_mcore(skip_lm_loss=True)`` zeroes the student's main-head LM
loss and keeps the MTP heads' loss, telling them apart by counting loss calls against
``config.mtp_num_layers``. A skip must therefore hide the MTP heads from that count, also on a
model whose ``forward`` takes Megatron-LM main's native ``compute_mtp_loss`` flag.
"""

from __future__ import annotations

import pytest
import torch

import mtp_hooks
import mtp_hooks_modelopt
from mtp_hooks.demo import tiny_models

import model_fixtures

mtd = pytest.importorskip("modelopt.torch.distill")
megatron_plugin = pytest.importorskip("modelopt.torch.distill.plugins.megatron")


def distill(build, kind: str, batch, *, hooks: bool, skip_lm_loss: bool, native: bool):
    """One training forward of ModelOpt's DistillationModel, as Megatron-Bridge sets it up."""
    cls = {"model_cls": model_fixtures.native(kind)} if native else {}
    student, teacher = build(seed=1, **cls), build(seed=2, **cls)
    cfg = megatron_plugin.setup_distillation_config(
        megatron_plugin.DistillationConfig(skip_lm_loss=skip_lm_loss),
        student.config,
        teacher.config,
    )
    kd_model = mtd.convert(
        student,
        mode=[
            (
                "kd_loss",
                {
                    "teacher_model": teacher,
                    "criterion": cfg.criterion,
                    "loss_balancer": cfg.loss_balancer,
                },
            )
        ],
    )
    megatron_plugin.adjust_distillation_model_for_mcore(kd_model, cfg)
    if hooks:  # after conversion, as a Megatron-Bridge user holds the teacher only then
        mtp_hooks_modelopt.prepare_distillation(kd_model, kd_model.teacher_model)
    tiny_models.reset_mtp_loss_tracker()
    kd_model.train()
    output = kd_model(*batch.args(), labels=batch.labels)
    losses = kd_model.compute_kd_loss(student_loss=output.mean(), skip_balancer=True)
    kd = [v[0] if isinstance(v, tuple) else v for k, v in losses.items() if k != "student_loss"]
    return (
        output.detach(),
        torch.stack([t.detach().sum() for t in kd]),
        tiny_models.recorded_mtp_loss(),
    )


@pytest.fixture(autouse=True)
def only_modelopt(only):
    only("modelopt")


@pytest.mark.parametrize("native", [True, False], ids=["native-flag", "gates"])
@pytest.mark.parametrize("skip_lm_loss", [True, False], ids=["skip_lm_loss", "keep_lm_loss"])
def test_the_student_lm_loss_is_exactly_what_modelopt_gives_without_mtp_hooks(
    build, kind, batch, native, skip_lm_loss
):
    plain_out, plain_kd, plain_mtp = distill(
        build, kind, batch, hooks=False, skip_lm_loss=skip_lm_loss, native=native
    )
    mtp_hooks.testing.reset()
    out, kd, mtp = distill(build, kind, batch, hooks=True, skip_lm_loss=skip_lm_loss, native=native)
    assert torch.equal(out, plain_out)
    assert torch.equal(kd, plain_kd)
    if skip_lm_loss:
        assert float(out.abs().sum()) == 0.0
    assert plain_mtp > 0 and mtp == 0.0  # MTP ran without mtp-hooks, and was skipped with it

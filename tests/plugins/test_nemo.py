"""mtp-hooks-nemo: policy.megatron_cfg MTP keys; train in the policy update only."""

from __future__ import annotations

import copy

import pytest
from omegaconf import OmegaConf

import mtp_hooks
import mtp_hooks_nemo

from model_fixtures import observe

MEGATRON_CFG = {
    "mtp_num_layers": 1,
    "mtp_loss_scaling_factor": 0.1,
    "mtp_use_repeated_layer": False,
    "mtp_detach_heads": False,
}


@pytest.fixture
def policy_model(build, only):
    only("nemo")
    model = build()
    mtp_hooks_nemo.skip_mtp_for_inference(model)
    return model


def test_mtp_runs_in_the_policy_update_and_skips_in_logprobs_and_eval(policy_model, batch):
    mtp_hooks_nemo.configure(OmegaConf.create(MEGATRON_CFG))
    assert observe(policy_model, batch, "train") == (True, True)
    assert observe(policy_model, batch, "rollout") == (False, False)
    assert observe(policy_model, batch, "eval")[0] is False


def test_compute_mtp_in_eval_opts_eval_in(policy_model, batch):
    mtp_hooks_nemo.configure(MEGATRON_CFG, compute_mtp_in_eval=True)
    assert observe(policy_model, batch, "eval")[0] is True


def test_the_shared_config_is_never_mutated(policy_model, batch):
    shared = policy_model.config
    before = dict(vars(shared))
    mtp_hooks_nemo.configure(MEGATRON_CFG)
    observe(policy_model, batch, "rollout")
    assert policy_model.config is shared and vars(shared) == before
    assert shared.mtp_num_layers == 1 and policy_model.mtp_process is True


def test_zero_mtp_layers_makes_the_plugin_abstain():
    mtp_hooks_nemo.configure({"mtp_num_layers": 0})
    assert mtp_hooks.decide(None, "train").votes["nemo"] is None


def test_an_absent_mtp_num_layers_keeps_the_checkpoints_value(policy_model, batch):
    mtp_hooks_nemo.configure({"enabled": True})  # as sft.yaml, dpo.yaml, the nanov3 recipes
    assert mtp_hooks_nemo.current().mtp_num_layers is None
    assert observe(policy_model, batch, "train") == (True, True)
    assert observe(policy_model, batch, "eval")[0] is False


def test_a_disabled_megatron_cfg_makes_the_plugin_abstain(only, build):
    only("nemo")
    mtp_hooks_nemo.configure({"enabled": False, "mtp_num_layers": 1})
    assert mtp_hooks.decide(build(), "rollout").votes["nemo"] is None


def test_a_zero_mtp_loss_weight_skips_mtp_in_the_policy_update(policy_model, batch):
    mtp_hooks_nemo.configure({**MEGATRON_CFG, "mtp_loss_scaling_factor": 0.0})
    assert observe(policy_model, batch, "train") == (False, False)


def test_in_a_worker_without_configure_the_models_config_decides(build, only, inside, batch):
    only("nemo")
    inside("nemo_rl")
    model = build()
    zero_weight = build(mtp_loss_scaling_factor=0.0)
    for m in (model, zero_weight):
        mtp_hooks.attach(m)
    assert observe(model, batch, "train") == (True, True)
    assert observe(model, batch, "eval") == (False, False)  # get_logprobs: eval + no_grad
    assert observe(zero_weight, batch, "train") == (False, False)


def test_a_whole_distillation_config_configures_policy_and_teacher(only, build):
    only("nemo")
    master = OmegaConf.create(
        {
            "policy": {
                "max_total_sequence_length": 8192,
                "train_mb_tokens": "${mul:${.max_total_sequence_length}, 2}",  # NeMo-RL resolver
                "megatron_cfg": {"enabled": True, "mtp_num_layers": 1},
            },
            "teacher": {"megatron_cfg": {"enabled": True, "mtp_loss_scaling_factor": 0.0}},
        }
    )
    assert mtp_hooks_nemo.configure_run(master) == [None, "teacher"]
    student, teacher = build(), build()
    mtp_hooks.attach(teacher, role="teacher")
    assert mtp_hooks.decide(student, "train").votes["nemo"] is True
    assert mtp_hooks.decide(teacher, "train").votes["nemo"] is False
    assert mtp_hooks.decide(teacher, "eval").votes["nemo"] is False


@pytest.mark.parametrize(
    ("change", "kwargs", "message"),
    [
        ({"enabled": "yes"}, {}, "'enabled' must be bool"),
        ({"mtp_loss_scaling_factor": -0.1}, {}, "must be >= 0"),
        ({"mtp_num_layers": "1"}, {}, "'mtp_num_layers' must be int"),
        ({"mtp_num_layers": -1}, {}, "must be >= 0"),
        ({"mtp_detach_heads": "no"}, {}, "'mtp_detach_heads' must be bool"),
        ({"mtp_loss_scaling_factor": None, "mtp_num_layers": True}, {}, "must be int, got True"),
        ({"mtp_num_layers": 0}, {"compute_mtp_in_eval": True}, "contradicts"),
    ],
)
def test_bad_megatron_cfg_names_the_key_and_changes_nothing(change, kwargs, message):
    mtp_hooks_nemo.configure(MEGATRON_CFG)
    cfg = copy.deepcopy(MEGATRON_CFG)
    cfg.update(change)
    with pytest.raises(mtp_hooks.PolicyError, match=message):
        mtp_hooks_nemo.configure(cfg, **kwargs)
    assert mtp_hooks_nemo.current().mtp_num_layers == 1

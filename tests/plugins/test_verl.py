"""mtp-hooks-verl: veRL's actor_rollout_ref.model.mtp config decides every phase."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

import mtp_hooks
import mtp_hooks_verl
from mtp_hooks import tiny_models


def run_phase(model, batch, phase: str) -> tuple[bool, bool]:
    """One forward in ``phase`` as veRL runs it; returns (MTP ran, MTP loss recorded)."""
    counter = {"n": 0}
    hook = model.mtp.register_forward_hook(lambda *a: counter.__setitem__("n", counter["n"] + 1))
    tiny_models.reset_mtp_loss_tracker()
    try:
        if phase == "train":  # the actor update
            model.train()
            model(*batch.args(), labels=batch.labels).sum().backward()
        elif phase == "rollout":  # compute_log_prob: no labels, no grad
            model.eval()
            with torch.no_grad(), mtp_hooks.phase("rollout"):
                model(*batch.args())
        else:  # validation
            model.eval()
            with torch.no_grad():
                model(*batch.args(), labels=batch.labels)
    finally:
        hook.remove()
    return counter["n"] > 0, tiny_models.recorded_mtp_loss() > 0


@pytest.fixture
def actor(build, only):
    only("verl")
    model = build()
    mtp_hooks.attach(model)
    return model


def test_with_enable_train_mtp_trains_in_the_actor_update_only(actor, batch):
    mtp_hooks_verl.configure(OmegaConf.create({"enable": True, "enable_train": True,
                                               "enable_rollout": True, "detach_encoder": False,
                                               "mtp_loss_scaling_factor": 0.1}))
    assert run_phase(actor, batch, "train") == (True, True)
    assert run_phase(actor, batch, "rollout") == (False, False)
    assert run_phase(actor, batch, "eval") == (False, False)


def test_with_enable_only_mtp_weights_are_kept_but_never_run(actor, batch):
    mtp_hooks_verl.configure({"enable": True, "enable_train": False})
    assert run_phase(actor, batch, "train") == (False, False)
    assert any(k.startswith("mtp.") for k in actor.state_dict())


def test_the_reference_model_never_runs_mtp(build, batch, only):
    only("verl")
    ref = build()
    mtp_hooks.attach(ref, role="ref")
    mtp_hooks_verl.configure({"enable": True, "enable_train": True})
    assert run_phase(ref, batch, "train") == (False, False)


def test_the_decision_names_the_verl_plugin(actor):
    mtp_hooks_verl.configure({"enable": True, "enable_train": True})
    assert mtp_hooks.decide(actor, "train").decided_by == "verl"


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"enable_train": True}, "missing key 'enable'"),
        ({"enable": "yes"}, "key 'enable' must be bool, got 'yes'"),
        ({"enable": True, "enable_train": 1}, "key 'enable_train' must be bool, got 1"),
        ({"enable": False, "enable_train": True}, "enable_train=True needs enable=True"),
        ({"enable": False, "enable_rollout": True}, "enable_rollout=True needs enable=True"),
        ({"enable": True, "mtp_loss_scaling_factor": "0.1"}, "'mtp_loss_scaling_factor' must be"),
        (["enable"], "expected a mapping"),
    ],
)
def test_bad_verl_config_names_the_key_and_changes_nothing(config, message):
    mtp_hooks_verl.configure({"enable": True, "enable_train": True})
    with pytest.raises(mtp_hooks.PolicyError, match=message) as info:
        mtp_hooks_verl.configure(config)
    assert "actor_rollout_ref.model.mtp" in str(info.value)
    assert mtp_hooks_verl.current().enable_train is True

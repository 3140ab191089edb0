"""mtp-hooks-verl: veRL's actor_rollout_ref.model.mtp config decides every phase."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

import mtp_hooks
import mtp_hooks_verl

from model_fixtures import observe


@pytest.fixture
def actor(build, only):
    only("verl")
    model = build()
    mtp_hooks.attach(model)
    return model


def test_with_enable_train_mtp_trains_in_the_actor_update_only(actor, batch):
    mtp_hooks_verl.configure(
        OmegaConf.create(
            {
                "enable": True,
                "enable_train": True,
                "enable_rollout": True,
                "detach_encoder": False,
                "mtp_loss_scaling_factor": 0.1,
            }
        )
    )
    assert observe(actor, batch, "train") == (True, True)
    assert observe(actor, batch, "rollout") == (False, False)
    assert observe(actor, batch, "eval") == (False, False)


def test_with_enable_only_mtp_weights_are_kept_but_never_run(actor, batch):
    mtp_hooks_verl.configure({"enable": True, "enable_train": False})
    assert observe(actor, batch, "train") == (False, False)
    assert any(k.startswith("mtp.") for k in actor.state_dict())


def test_the_reference_model_never_runs_mtp(build, batch, only):
    only("verl")
    ref = build()
    mtp_hooks.attach(ref, role="ref")
    mtp_hooks_verl.configure({"enable": True, "enable_train": True})
    assert observe(ref, batch, "train") == (False, False)


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


def test_the_verl_vote_is_reused_until_verl_is_configured_again(actor, batch, monkeypatch):
    import mtp_hooks_verl.hooks

    asked = []
    vote = mtp_hooks_verl.hooks.vote
    monkeypatch.setattr(
        mtp_hooks_verl.hooks,
        "vote",
        lambda m, phase, call: asked.append(phase) or vote(m, phase, call),
    )
    observe(actor, batch, "eval")  # the first forward also loads the plugins
    asked.clear()
    mtp_hooks_verl.configure({"enable": True, "enable_train": True})
    for _ in range(3):
        observe(actor, batch, "eval")
    assert asked == ["eval"]
    mtp_hooks_verl.configure({"enable": True, "enable_train": False})
    observe(actor, batch, "eval")
    assert asked == ["eval", "eval"]

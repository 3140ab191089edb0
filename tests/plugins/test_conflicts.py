"""Two installed plugins that disagree: a conflict error, settled by the user's config."""

from __future__ import annotations

import pytest

import mtp_hooks
import mtp_hooks_nemo
import mtp_hooks_verl


@pytest.fixture
def disagreeing_on_eval(only):
    only("verl", "nemo")
    mtp_hooks_verl.configure({"enable": True, "enable_train": True})  # eval: skip
    mtp_hooks_nemo.configure({"mtp_num_layers": 1}, compute_mtp_in_eval=True)  # eval: run


def test_installed_plugins_that_disagree_raise_a_conflict(disagreeing_on_eval, build, batch):
    model = build()
    mtp_hooks.attach(model)
    model.eval()
    with pytest.raises(mtp_hooks.PolicyConflictError) as info:
        model(*batch.args(), labels=batch.labels)
    assert "nemo=run" in str(info.value) and "verl=skip" in str(info.value)


def test_the_user_config_settles_the_conflict(disagreeing_on_eval, monkeypatch):
    monkeypatch.setenv("MTP_HOOKS_POLICY", "eval=skip")
    decision = mtp_hooks.decide(None, "eval")
    assert (decision.run, decision.decided_by) == (False, "config")


def test_where_they_agree_both_are_named(disagreeing_on_eval):
    decision = mtp_hooks.decide(None, "rollout")
    assert (decision.run, decision.decided_by) == (False, "nemo,verl")

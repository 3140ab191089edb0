"""Asking for MTP metrics in the policy (``+metrics``): syntax, validation, and what it decides."""

from __future__ import annotations

import pytest

import mtp_hooks


@pytest.mark.parametrize(
    ("policy", "loss_scale"),
    [
        ("eval=run+metrics", None),
        ("eval = RUN + metrics", None),
        ("eval=run:0.3+metrics", 0.3),
        ({"eval": {"mtp": "run", "metrics": True}}, None),
        ({"eval": {"mtp": "run", "loss_scale": 0.3, "metrics": True}}, 0.3),
    ],
)
def test_metrics_ride_on_run_in_every_form(policy, loss_scale):
    mtp_hooks.configure(policy)
    decision = mtp_hooks.decide(None, "eval")
    assert (decision.run, decision.metrics, decision.loss_scale) == (True, True, loss_scale)
    assert mtp_hooks.decide(None, "train").metrics is False


def test_auto_with_metrics_records_only_when_the_plugins_run_mtp(voter):
    mtp_hooks.configure("eval=auto+metrics")
    plugin = voter(True, name="runs-eval")
    assert mtp_hooks.decide(None, "eval").metrics is True
    plugin.value = False
    mtp_hooks.configure("eval=auto+metrics")  # a new generation: decide again
    decision = mtp_hooks.decide(None, "eval")
    assert (decision.run, decision.metrics) == (False, False)


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ("eval=skip+metrics", r"key 'eval': '\+metrics' needs MTP to run; write 'run\+metrics'"),
        ("eval=run+stats", r"unknown option '\+stats': the '\+' options are '\+metrics', "),
        ("eval=run+metrics+metrics", r"give '\+metrics' once"),
        ({"eval": {"mtp": "skip", "metrics": True}}, r"'\+metrics' needs MTP to run"),
        ({"eval": {"mtp": "run", "metrics": "yes"}}, "'metrics' is true or false, not 'yes'"),
        ({"eval": {"mtp": "run+metrics"}}, "a table takes 'mtp'"),
    ],
)
def test_malformed_metrics_are_a_policy_error_that_changes_nothing(policy, message):
    mtp_hooks.configure("eval=run")
    with pytest.raises(mtp_hooks.PolicyError, match=message):
        mtp_hooks.configure(policy)
    assert mtp_hooks.decide(None, "eval").metrics is False


def test_explain_and_check_config_show_metrics(tmp_path, capsys):
    from mtp_hooks import cli

    mtp_hooks.configure("eval=run:0.2+metrics")
    assert "metrics: recorded" in mtp_hooks.explain(None, "eval")
    path = tmp_path / "mtp.toml"
    path.write_text('[policy]\neval = {mtp = "run", metrics = true}\n')
    assert cli.main(["check-config", str(path)]) == 0
    assert "eval = run+metrics" in capsys.readouterr().out

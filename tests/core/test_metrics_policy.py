"""Asking for MTP metrics in the policy (``+metrics``): what ``explain`` and ``check-config``
show. Its syntax and checks, which every flag option shares, are in test_policy_options.py."""

from __future__ import annotations

import mtp_hooks


def test_explain_and_check_config_show_metrics(tmp_path, capsys):
    from mtp_hooks import cli

    mtp_hooks.configure("eval=run:0.2+metrics")
    assert "metrics: recorded" in mtp_hooks.explain(None, "eval")
    path = tmp_path / "mtp.toml"
    path.write_text('[policy]\neval = {mtp = "run", metrics = true}\n')
    assert cli.main(["check-config", str(path)]) == 0
    assert "eval = run+metrics" in capsys.readouterr().out

"""The framework plugins are real installed distributions found through the entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import mtp_hooks

EXPECTED = {"verl": "mtp-hooks-verl", "modelopt": "mtp-hooks-modelopt", "nemo": "mtp-hooks-nemo"}


def test_plugins_json_lists_each_installed_plugin_with_distribution_and_version():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MTP_HOOKS_")}
    out = subprocess.run(
        [sys.executable, "-m", "mtp_hooks", "plugins", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    listed = {e["name"]: e for e in json.loads(out.stdout)}
    for name, dist in EXPECTED.items():
        assert listed[name]["distribution"] == dist
        assert listed[name]["version"] == "0.1.0"
        assert listed[name]["hooks"] == ["should_run_mtp"]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_an_unconfigured_plugin_abstains(name):
    decision = mtp_hooks.decide(None, "train")
    assert decision.votes[name] is None and decision.decided_by == "default"

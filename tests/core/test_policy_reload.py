"""When the policy sources are read again: file edits, reload(), the working directory."""

from __future__ import annotations

import os

import pytest

import mtp_hooks


def run_in(phase: str) -> bool:
    return mtp_hooks.decide(None, phase).run


@pytest.fixture
def policy_file(tmp_path, monkeypatch):
    path = tmp_path / "mtp.toml"
    path.write_text('[policy]\neval = "skip"\n')
    monkeypatch.setenv("MTP_HOOKS_CONFIG", str(path))
    monkeypatch.setenv("MTP_HOOKS_CONFIG_POLL", "0")
    return path


def test_an_edit_that_keeps_size_and_timestamps_is_still_picked_up(policy_file):
    assert run_in("eval") is False
    stat = os.stat(policy_file)
    policy_file.write_text('[policy]\neval = "run "\n')  # same length as before
    os.utime(policy_file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.stat(policy_file).st_size == stat.st_size
    assert run_in("eval") is True


def test_a_relative_config_path_survives_a_chdir(tmp_path, monkeypatch):
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "mtp.toml").write_text('[policy]\neval = "skip"\n')
    monkeypatch.chdir(tmp_path / "job")
    monkeypatch.setenv("MTP_HOOKS_CONFIG", "mtp.toml")
    monkeypatch.setenv("MTP_HOOKS_CONFIG_POLL", "0")
    assert run_in("eval") is False
    monkeypatch.chdir(tmp_path)  # as Hydra does after start-up
    assert run_in("eval") is False


def test_without_polling_an_edit_waits_for_reload(policy_file, monkeypatch):
    monkeypatch.setenv("MTP_HOOKS_CONFIG_POLL", "3600")
    mtp_hooks.reload()
    assert run_in("eval") is False
    policy_file.write_text('[policy]\neval = "run"\n')
    assert run_in("eval") is False
    mtp_hooks.reload()
    assert run_in("eval") is True


def test_the_policy_variable_is_read_at_first_use_and_by_reload(monkeypatch):
    monkeypatch.setenv("MTP_HOOKS_POLICY", "eval=skip")
    assert run_in("eval") is False
    monkeypatch.setenv("MTP_HOOKS_POLICY", "eval=run")
    assert run_in("eval") is False
    mtp_hooks.reload()
    assert run_in("eval") is True


def test_a_broken_edit_is_reported_until_fixed_and_changes_nothing(policy_file):
    assert run_in("eval") is False
    policy_file.write_text('[policy]\neval = "skp"\n')
    for _ in range(2):
        with pytest.raises(mtp_hooks.PolicyError, match="mtp.toml.*'skp'"):
            run_in("eval")
    policy_file.write_text('[policy]\neval = "run"\n')
    assert run_in("eval") is True


def test_a_failed_reload_keeps_the_previous_policy(policy_file, monkeypatch):
    assert run_in("eval") is False
    monkeypatch.setenv("MTP_HOOKS_POLICY", "eval=maybe")
    with pytest.raises(mtp_hooks.PolicyError, match="MTP_HOOKS_POLICY.*maybe"):
        mtp_hooks.reload()
    assert run_in("eval") is False


def test_a_malformed_poll_interval_is_named(monkeypatch):
    monkeypatch.setenv("MTP_HOOKS_CONFIG_POLL", "soon")
    with pytest.raises(mtp_hooks.PolicyError, match="MTP_HOOKS_CONFIG_POLL='soon'"):
        run_in("eval")

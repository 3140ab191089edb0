"""The ``mtp-hooks`` command line, run as a subprocess."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

import mtp_hooks

from command_line import cli


@pytest.fixture
def plugin_dir(tmp_path):
    (tmp_path / "mtpx_cli.py").write_text(
        textwrap.dedent(
            """
            import mtp_hooks

            @mtp_hooks.plugins.hookimpl
            def should_run_mtp(model, phase):
                return False if phase == "rollout" else None
            """
        )
    )
    info = tmp_path / "mtpx_cli-0.4.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mtpx-cli\nVersion: 0.4\n")
    (info / "entry_points.txt").write_text("[mtp_hooks]\nmtpx-cli = mtpx_cli\n")
    # the framework plugins of plugins/ may be installed too, and vote once configured
    return {"PYTHONPATH": str(tmp_path), "MTP_HOOKS_DISABLE": "verl,nemo,modelopt"}


def test_plugins_json_lists_an_installed_plugin_with_its_distribution(plugin_dir):
    out = cli("plugins", "--json", env=plugin_dir)
    assert out.returncode == 0, out.stderr
    entries = {e["name"]: e for e in json.loads(out.stdout)}
    assert entries["mtpx-cli"]["distribution"] == "mtpx-cli"
    assert entries["mtpx-cli"]["version"] == "0.4"
    assert entries["mtpx-cli"]["hooks"] == ["should_run_mtp"]


ECHO_OPTION = """
from mtp_hooks.plugins import Flag


class Echo(Flag):
    name = "echo"
"""


def test_options_lists_each_option_with_how_it_is_written_and_who_contributes_it(install, tmp_path):
    install("mtpx-echo", ECHO_OPTION, "echo", version="0.2", group="mtp_hooks.options",
            attribute="Echo")  # fmt: skip
    env = {"PYTHONPATH": str(tmp_path), "MTP_HOOKS_DISABLE": "verl,nemo,modelopt"}
    out = cli("options", "--json", env=env)
    assert out.returncode == 0, out.stderr
    listed = {entry["name"]: entry for entry in json.loads(out.stdout)}
    assert listed["echo"] == {
        "name": "echo",
        "written": ["+echo"],
        "keys": ["echo"],
        "hook": None,
        "distribution": "mtpx-echo",
        "version": "0.2",
    }
    assert listed["objective"]["written"] == ["+objective:ce", "+objective:kl", "+objective:tv"]
    assert (listed["detach"]["hook"], listed["detach"]["distribution"]) == (
        "mtp_detach_heads",
        None,
    )
    assert list(listed)[-1] == "echo"  # after the built-in options, as the parser reads them
    lines = cli("options", env=env).stdout.splitlines()
    assert any(line.startswith("+objective:ce|kl|tv") for line in lines)
    assert lines[-1].split()[0] == "+echo" and lines[-1].endswith("mtpx-echo 0.2")
    autoload_off = cli("options", env={**env, "MTP_HOOKS_DISABLE_PLUGIN_AUTOLOAD": "1"}).stdout
    assert "+echo" in autoload_off  # the switch keeps plugins out, not the policy's words
    kept_out = cli("options", env={**env, "MTP_HOOKS_DISABLE": "echo"}).stdout
    assert "+echo" not in kept_out and "+detach" in kept_out


def test_plugins_marks_blocked_plugins(plugin_dir):
    out = cli("plugins", env={**plugin_dir, "MTP_HOOKS_DISABLE": "mtpx-cli"})
    assert out.returncode == 0 and "mtpx-cli" in out.stdout and "BLOCKED" in out.stdout


def test_explain_shows_the_plugin_decision(plugin_dir):
    out = cli("explain", "--phase", "rollout", env=plugin_dir)
    assert out.returncode == 0, out.stderr
    assert "result: skip (decided by mtpx-cli)" in out.stdout


def test_explain_uses_the_role_and_the_env_config():
    out = cli(
        "explain",
        "--phase",
        "train",
        "--role",
        "teacher",
        env={"MTP_HOOKS_POLICY": "train=run,teacher.train=skip"},
    )
    assert out.returncode == 0, out.stderr
    assert "role: teacher" in out.stdout and "result: skip (decided by config)" in out.stdout


def test_check_config_accepts_a_valid_file(tmp_path):
    path = tmp_path / "ok.toml"
    path.write_text(
        '[policy]\ntrain = "run"\neval = "skip"\n[policy.roles.teacher]\ntrain = "skip"\n'
    )
    out = cli("check-config", str(path))
    assert out.returncode == 0, out.stderr
    assert "teacher.train = skip" in out.stdout and "valid (3 entries)" in out.stdout


def test_check_config_shows_every_mask_setting_including_the_toml_only_ones(tmp_path):
    path = tmp_path / "masks.toml"
    path.write_text(
        "[policy]\n"
        'train = {mtp = "run", mask = "labels", ignore_index = 0, plugin_masks = false}\n'
        'eval = "run+mask:labels+metrics"\n'
    )
    out = cli("check-config", str(path))
    assert out.returncode == 0, out.stderr
    assert "eval = run+metrics+mask:labels\n" in out.stdout
    assert "train = run+mask:labels (ignore_index = 0) (plugin_masks = false)\n" in out.stdout


def test_check_config_shows_the_objectives_temperature_it_validated(tmp_path):
    path = tmp_path / "objective.toml"
    path.write_text(
        '[policy]\ntrain = {mtp = "run", detach = true, objective = "kl", temperature = 0.7}\n'
    )
    out = cli("check-config", str(path))
    # valid as written; a megatron-core without +detach fails it apart (test_check_config_on_...)
    assert out.returncode == 0 or "no mtp_detach_heads field" in out.stderr, out.stderr
    assert "train = run+detach+objective:kl (temperature = 0.7)\n" in out.stdout


def test_check_config_rejects_an_invalid_file_with_one_line(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[policy]\neval = "sometimes"\n')
    out = cli("check-config", str(path))
    assert out.returncode == 2
    assert out.stderr.startswith("mtp-hooks: error:") and "'sometimes'" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    # the file came as an argument, not from the environment: named as given
    assert f"file {str(path)!r}" in out.stderr and "MTP_HOOKS_CONFIG" not in out.stderr


def test_an_unknown_phase_exits_non_zero_without_a_traceback():
    out = cli("explain", "--phase", "prefill")
    assert out.returncode == 2 and "unknown phase 'prefill'" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_broken_plugin_is_reported_in_one_line(tmp_path):
    (tmp_path / "mtpx_bad.py").write_text("raise ImportError('nope')\n")
    info = tmp_path / "mtpx_bad-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mtpx-bad\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[mtp_hooks]\nmtpx-bad = mtpx_bad\n")
    out = cli("plugins", env={"PYTHONPATH": str(tmp_path)})
    assert out.returncode == 2 and "MTP_HOOKS_DISABLE=mtpx-bad" in out.stderr
    assert "Traceback" not in out.stderr


def test_the_console_script_is_installed():
    exe = os.path.join(os.path.dirname(sys.executable), "mtp-hooks")
    out = subprocess.run(
        [exe, "explain", "--phase", "eval"],
        capture_output=True,
        text=True,
        env={**os.environ, "MTP_HOOKS_DISABLE_PLUGIN_AUTOLOAD": "1"},
        timeout=120,
    )
    assert out.returncode == 0 and "result: run (decided by default)" in out.stdout


@pytest.mark.parametrize(
    ("policy", "valid"),
    [("train=run,eval=skip", "valid (2 entries)"), ("", "valid (0 entries)"),
     ("train=run,", None), (",", None), (",train=run", None), ("train=run,,eval=skip", None)],
)  # fmt: skip
def test_check_config_checks_a_policy_string_as_configure_does(policy, valid):
    out = cli("check-config", "--policy", policy)
    if valid is None:
        assert out.returncode == 2 and "is empty (a stray comma)" in out.stderr
        with pytest.raises(mtp_hooks.PolicyError, match="stray comma"):
            mtp_hooks.configure(policy)
    else:
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip().endswith(valid)
        mtp_hooks.configure(policy)


def test_check_config_wants_a_file_or_a_policy_string_not_both():
    out = cli("check-config", "x.toml", "--policy", "train=run")
    assert out.returncode == 2 and "one of the two" in out.stderr


def test_check_config_with_neither_checks_what_the_environment_sets(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[policy]\neval = "skip"\n')
    out = cli("check-config", env={"MTP_HOOKS_POLICY": "train=run", "MTP_HOOKS_CONFIG": str(path)})
    assert out.returncode == 0, out.stderr
    assert "MTP_HOOKS_POLICY='train=run': valid (1 entry)" in out.stdout
    assert f"MTP_HOOKS_CONFIG file {str(path)!r}: valid (1 entry)" in out.stdout
    bad = cli("check-config", env={"MTP_HOOKS_POLICY": "train=skp"})
    assert bad.returncode == 2 and "MTP_HOOKS_POLICY='train=skp'" in bad.stderr
    assert "(did you mean 'skip'?)" in bad.stderr


def test_check_config_with_nothing_to_check_says_what_it_checks():
    out = cli("check-config")
    assert out.returncode == 2
    assert "nothing to check" in out.stderr and "MTP_HOOKS_POLICY" in out.stderr


def test_version_prints_the_installed_version():
    import importlib.metadata

    out = cli("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"mtp-hooks {importlib.metadata.version('mtp-hooks')}"


def test_the_demo_without_megatron_says_which_extra_to_install_in_one_line():
    import importlib.util

    if importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("torch"):
        pytest.skip("megatron-core and torch are installed here (the core session has neither)")
    out = cli("demo")
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("mtp-hooks: error: ")
    assert "'.[megatron]'" in out.stderr and "Traceback" not in out.stderr


def test_check_config_names_every_error_of_a_string_with_did_you_mean():
    out = cli("check-config", "--policy", "train=run,eval=skp,rolout=skip,train=run:abc")
    assert out.returncode == 2 and out.stdout == ""
    assert "3 errors in this policy" in out.stderr
    assert "'skp' (did you mean 'skip'?)" in out.stderr
    assert "'rolout' (did you mean 'rollout'?)" in out.stderr
    assert "loss weight 'abc'" in out.stderr


@pytest.mark.parametrize(
    ("policy", "hint"),
    [
        ("trian=run", "(did you mean 'train'?)"),
        ("train=run+detatch", "(did you mean '+detach'?)"),
        ("train=rnu", "(did you mean 'run'?)"),
        ("train=run+objective:kll+detach", "objective 'kll' (did you mean 'kl'?)"),
        ("evaluation=skip", "'evaluation' (did you mean 'eval'?)"),
        ("train=run;eval=skip", "(items are separated by ',', not ';')"),
    ],
)
def test_a_typo_in_a_policy_string_gets_the_nearest_spelling(policy, hint):
    out = cli("check-config", "--policy", policy)
    assert out.returncode == 2 and hint in out.stderr, out.stderr


def test_explain_of_a_role_the_policy_does_not_name_says_so_with_the_nearest_one():
    out = cli(
        "explain",
        "--role",
        "teachr",
        "--phase",
        "train",
        env={"MTP_HOOKS_POLICY": "teacher.train=skip"},
    )
    assert out.returncode == 0, out.stderr
    assert "no entry for role 'teachr' (did you mean 'teacher'?)" in out.stdout
    assert out.stdout.strip().endswith("result: run (decided by default)")
    named = cli(
        "explain",
        "--role",
        "teacher",
        "--phase",
        "train",
        env={"MTP_HOOKS_POLICY": "teacher.train=skip"},
    )
    assert "note:" not in named.stdout and "result: skip" in named.stdout


@pytest.mark.parametrize(
    "policy", [{"trian": "skp"}, {"roles": {"teacher": {"trian": "skp"}}}, "trian=skp"]
)
def test_a_bad_key_hides_no_error_of_its_value_in_any_spelling_of_a_policy(policy):
    with pytest.raises(mtp_hooks.PolicyError) as info:
        mtp_hooks.configure(policy)
    assert [e.option for e in info.value.errors] == [None, "skp"]
    assert "(did you mean 'train'?)" in str(info.value) and "(did you mean 'skip'?)" in str(
        info.value
    )


def test_a_roles_table_spelt_role_points_to_roles(tmp_path):
    path = tmp_path / "role.toml"
    path.write_text('[policy]\ntrain = "run"\n[policy.role.teacher]\ntrain = "skip"\n')
    out = cli("check-config", str(path))
    assert out.returncode == 2 and "key 'role' (did you mean 'roles'?)" in out.stderr
    assert "[policy.roles.teacher]" in out.stderr and "unknown phase" not in out.stderr


def test_a_typo_in_a_toml_tables_mtp_value_gets_the_nearest_spelling(tmp_path):
    path = tmp_path / "typo.toml"
    path.write_text('[policy]\neval = { mtp = "skp" }\n')
    out = cli("check-config", str(path))
    assert out.returncode == 2 and "'mtp' = 'skp' (did you mean 'skip'?)" in out.stderr


def test_check_config_names_an_unknown_toml_key_and_every_other_error(tmp_path):
    path = tmp_path / "typos.toml"
    path.write_text('[policy]\ntrain = {mtp = "run", detatch = true}\neval = "skp"\n')
    out = cli("check-config", str(path))
    assert out.returncode == 2
    assert "2 errors in this policy" in out.stderr
    assert "unknown table key 'detatch' (did you mean 'detach'?)" in out.stderr
    assert "{'mtp'" not in out.stderr  # the key is named, not the whole table dumped
    assert "'skp' (did you mean 'skip'?)" in out.stderr


def test_one_entry_is_one_entry():
    out = cli("check-config", "--policy", "train=run")
    assert out.returncode == 0 and "valid (1 entry)" in out.stdout


def test_explain_takes_a_policy_of_its_own_and_names_it_in_errors():
    out = cli("explain", "--phase", "eval", "--policy", "train=run,eval=skip")
    assert out.returncode == 0, out.stderr
    assert "config: skip (from --policy)" in out.stdout and "result: skip" in out.stdout
    out = cli("explain", "--phase", "eval", "--policy", "eval=skp")
    assert out.returncode == 2 and "--policy: key 'eval'" in out.stderr
    assert "did you mean 'skip'?" in out.stderr


def test_explain_with_a_policy_of_its_own_reads_none_of_the_environments(tmp_path):
    broken = tmp_path / "broken.toml"
    broken.write_text("[policy\n")
    env = {"MTP_HOOKS_POLICY": "train=skip", "MTP_HOOKS_CONFIG": str(broken)}
    out = cli("explain", "--phase", "train", "--policy", "eval=run", env=env)
    assert out.returncode == 0, out.stderr
    assert "result: run" in out.stdout and "MTP_HOOKS_POLICY" not in out.stdout
    out = cli("explain", "--phase", "train", env={"MTP_HOOKS_POLICY": "train=skip"})
    assert "result: skip" in out.stdout  # without --policy, the environment's


def test_every_option_of_every_subcommand_says_what_it_takes():
    for command in ("plugins", "explain", "check-config", "demo"):
        out = cli(command, "--help")
        options = re.findall(r"^  (--?[a-z-]+(?: [A-Z_]+)?)(.*)$", out.stdout, flags=re.M)
        assert options and all(text.strip() for _, text in options), (command, options)


@pytest.mark.skipif(
    importlib.util.find_spec("megatron") is not None, reason="a megatron-core is installed here"
)
def test_check_config_says_detach_goes_unchecked_where_no_megatron_core_is_installed():
    out = cli("check-config", "--policy", "train=run+detach,eval=skip")
    assert out.returncode == 0, out.stderr
    assert "train: +detach not checked against a megatron-core, as none is installed" in out.stderr
    assert out.stdout.strip().endswith("valid (2 entries)")

"""The per-phase policy config: its three sources, their precedence, and validation."""

from __future__ import annotations

import pytest

import mtp_hooks

from plugin_answers import Model


def decided(phase: str, model: object = None) -> tuple[bool, str]:
    d = mtp_hooks.decide(model, phase)
    return d.run, d.decided_by


@pytest.fixture
def toml_file(tmp_path, monkeypatch):
    """Write a TOML file and point MTP_HOOKS_CONFIG at it."""

    def write(text: str):
        path = tmp_path / "mtp.toml"
        path.write_text(text)
        monkeypatch.setenv("MTP_HOOKS_CONFIG", str(path))
        return path

    return write


def test_configure_accepts_the_compact_string():
    mtp_hooks.configure("train=run, eval=skip ,rollout=skip")
    assert [decided(p)[0] for p in ("train", "eval", "rollout")] == [True, False, False]


def test_configure_accepts_a_dict_shaped_like_the_toml_table():
    teacher = Model()
    mtp_hooks.set_role(teacher, "teacher")
    mtp_hooks.configure({"train": "run", "roles": {"teacher": {"train": "skip"}}})
    assert decided("train") == (True, "config")
    assert decided("train", teacher) == (False, "config")


def test_configure_none_clears_the_config():
    mtp_hooks.configure("eval=skip")
    mtp_hooks.configure(None)
    assert decided("eval") == (True, "default")


def test_the_policy_env_var_is_read(monkeypatch):
    monkeypatch.setenv("MTP_HOOKS_POLICY", "eval=skip,teacher.train=skip")
    assert decided("eval") == (False, "config")


def test_the_toml_file_is_read(toml_file):
    toml_file('[policy]\neval = "skip"\n[policy.roles.teacher]\ntrain = "skip"\n')
    teacher = Model()
    mtp_hooks.set_role(teacher, "teacher")
    assert decided("eval") == (False, "config")
    assert decided("train", teacher) == (False, "config")
    assert decided("train") == (True, "default")


def test_configure_beats_the_env_var_which_beats_the_file(monkeypatch, toml_file):
    toml_file('[policy]\ntrain = "skip"\neval = "skip"\nrollout = "skip"\n')
    monkeypatch.setenv("MTP_HOOKS_POLICY", "eval=run,rollout=run")
    mtp_hooks.configure("rollout=skip")
    sources = {p: mtp_hooks.decide(None, p).source for p in ("train", "eval", "rollout")}
    assert decided("train")[0] is False and "file" in sources["train"]
    assert decided("eval")[0] is True and sources["eval"].startswith("MTP_HOOKS_POLICY")
    assert decided("rollout")[0] is False and sources["rollout"] == "mtp_hooks.configure()"


def test_an_edited_file_is_reread(toml_file, monkeypatch):
    monkeypatch.setenv("MTP_HOOKS_CONFIG_POLL", "0")  # check the file at every decision
    path = toml_file('[policy]\neval = "skip"\n')
    assert decided("eval")[0] is False
    path.write_text('[policy]\neval = "run"   # changed\n')
    assert decided("eval")[0] is True


def test_a_custom_phase_must_be_declared_before_the_config_uses_it():
    with pytest.raises(mtp_hooks.PolicyError, match="unknown phase 'distill'"):
        mtp_hooks.configure("distill=skip")
    mtp_hooks.declare_phase("distill")
    mtp_hooks.configure("distill=skip")
    assert decided("distill") == (False, "config")


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ("evl=skip", r"mtp_hooks.configure\(\): key 'evl'.*unknown phase 'evl'.*train, eval"),
        ("eval=maybe", r"key 'eval' has value 'maybe'; allowed values are 'run', 'skip', 'auto'"),
        ("=skip", r"empty key ''"),
        ("eval=skip,eval=run", r"duplicate key 'eval'"),
        ("eval", r"item 'eval' has no '='"),
        ("bad role.eval=skip", r"malformed role 'bad role'"),
        ({"eval": True}, r"key 'eval' has value True"),
        ({"roles": ["teacher"]}, r"key 'roles' must be a table"),
        ({"roles": {"teacher": "skip"}}, r"key 'roles.teacher' must be a table"),
        ({"teacher.eval": "skip", "roles": {"teacher": {"eval": "run"}}}, r"duplicate key"),
        (42, r"a policy is a dict or a string"),
    ],
)
def test_a_malformed_policy_names_the_problem_and_changes_nothing(policy, message):
    mtp_hooks.configure("eval=skip")
    with pytest.raises(mtp_hooks.PolicyError, match=message):
        mtp_hooks.configure(policy)
    assert decided("eval") == (False, "config")


def test_a_malformed_env_var_names_the_variable_and_the_value(monkeypatch):
    monkeypatch.setenv("MTP_HOOKS_POLICY", "eval=skp")
    with pytest.raises(mtp_hooks.PolicyError, match="MTP_HOOKS_POLICY='eval=skp': key 'eval'"):
        mtp_hooks.decide(None, "eval")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[policy\neval = 1", "invalid TOML"),
        ('policy = "eval=skip"\n', "key 'policy' must be a table"),
        ('[other]\neval = "skip"\n', "no \\[policy\\] table"),
        ('[policy]\neval = "off"\n', "key 'eval' has value 'off'"),
        ('[policy]\nprefill = "skip"\n', "unknown phase 'prefill'"),
        ('[policy]\n"" = "skip"\n', "empty key"),
    ],
)
def test_a_malformed_file_names_the_file_and_the_problem(toml_file, text, message):
    path = toml_file(text)
    with pytest.raises(mtp_hooks.PolicyError, match=message) as info:
        mtp_hooks.decide(None, "eval")
    assert str(path) in str(info.value)


def test_a_duplicate_key_in_toml_is_reported(toml_file):
    toml_file('[policy]\neval = "skip"\neval = "run"\n')
    with pytest.raises(mtp_hooks.PolicyError, match="invalid TOML"):
        mtp_hooks.decide(None, "eval")


def test_a_missing_file_is_reported(monkeypatch, tmp_path):
    monkeypatch.setenv("MTP_HOOKS_CONFIG", str(tmp_path / "nope.toml"))
    with pytest.raises(mtp_hooks.PolicyError, match="nope.toml.*cannot read it"):
        mtp_hooks.decide(None, "eval")

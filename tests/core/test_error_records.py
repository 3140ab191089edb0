"""Every error names its culprit in attributes beside its message (phase, role, option,
source, plugin, hook), so that a framework can act on it without parsing text."""

from __future__ import annotations

import pickle

import pytest

import mtp_hooks
from mtp_hooks import (
    MTPHooksError,
    PluginError,
    PolicyConflictError,
    PolicyError,
    UnknownPluginError,
)

from plugin_answers import Model, answers

SOURCE = "mtp_hooks.configure()"


def attributes(error: MTPHooksError) -> dict[str, str | None]:
    return {name: getattr(error, name) for name in ("phase", "role", "option", "source")}


@pytest.mark.parametrize(
    ("policy", "phase", "role", "option"),
    [
        ("train=run,teacher.eval=skp", "eval", "teacher", "skp"),
        ("eval=run+detatch", "eval", None, "+detatch"),
        ("eval=skip+metrics", "eval", None, "+metrics"),
        ("rollout=run:abc", "rollout", None, "run:abc"),
        ("trian=run", "trian", None, None),
        ("student.eval=run+metrics+metrics", "eval", "student", "+metrics"),
    ],
)
def test_a_policy_error_names_its_phase_role_option_and_source(policy, phase, role, option):
    with pytest.raises(PolicyError) as info:
        mtp_hooks.configure(policy)
    assert attributes(info.value) == {
        "phase": phase,
        "role": role,
        "option": option,
        "source": SOURCE,
    }
    assert info.value.plugin is None and info.value.errors == ()


def test_every_error_of_one_policy_is_a_record_of_its_own():
    with pytest.raises(PolicyError) as info:
        mtp_hooks.configure("train=run,eval=skp,rolout=skip,teacher.train=run:abc")
    assert info.value.source == SOURCE and info.value.phase is None
    assert [attributes(e) for e in info.value.errors] == [
        {"phase": "eval", "role": None, "option": "skp", "source": SOURCE},
        {"phase": "rolout", "role": None, "option": None, "source": SOURCE},
        {"phase": "train", "role": "teacher", "option": "run:abc", "source": SOURCE},
    ]
    assert all(str(e) in str(info.value) for e in info.value.errors)


def test_a_malformed_role_name_hides_no_other_roles_error_in_either_order():
    bad, typo = ("bad name!", {"train": "run"}), ("teacher", {"trian": "run"})
    for roles in (dict([bad, typo]), dict([typo, bad])):
        with pytest.raises(mtp_hooks.PolicyError) as info:
            mtp_hooks.configure({"roles": roles})
        messages = [str(e) for e in info.value.errors]
        assert len(messages) == 2, messages
        assert any("'bad name!' in 'roles' is not an identifier" in m for m in messages)
        assert any("unknown phase 'trian' (did you mean 'train'?)" in m for m in messages)


def test_every_typo_of_one_item_gets_its_own_record_and_hint():
    with pytest.raises(mtp_hooks.PolicyError) as info:
        mtp_hooks.configure("trian=skp+detatch,eval=run")
    hints = sorted(str(e).split("(did you mean ")[1].split(")")[0] for e in info.value.errors)
    assert hints == ["'+detach'?", "'skip'?", "'train'?"]
    assert [(e.phase, e.option) for e in info.value.errors] == [
        ("trian", None),
        (None, "skp"),
        (None, "+detatch"),
    ]
    assert mtp_hooks.decide(None, "eval").decided_by == "default"  # nothing was applied


def test_a_table_error_names_the_table_key_at_fault():
    with pytest.raises(PolicyError) as info:
        mtp_hooks.configure({"roles": {"teacher": {"eval": {"mtp": "run", "detatch": True}}}})
    assert attributes(info.value) == {
        "phase": "eval",
        "role": "teacher",
        "option": "detatch",
        "source": SOURCE,
    }


def test_a_policy_file_error_names_the_file(tmp_path, monkeypatch):
    path = tmp_path / "policy.toml"
    path.write_text("[policy]\neval = 'skp'\n")
    monkeypatch.setenv("MTP_HOOKS_CONFIG", str(path))
    with pytest.raises(PolicyError) as info:
        mtp_hooks.reload()
    assert str(path) in info.value.source
    assert (info.value.phase, info.value.option) == ("eval", "skp")


def test_a_plugin_that_raises_is_named_with_its_hook_phase_and_role():
    model = Model()
    mtp_hooks.set_role(model, "student")
    answers("should_run_mtp", KeyError("step"), name="broken")
    with pytest.raises(PluginError) as info:
        mtp_hooks.decide(model, "eval")
    error = info.value
    assert (error.plugin, error.hook, error.phase, error.role) == (
        "broken",
        "should_run_mtp",
        "eval",
        "student",
    )
    assert isinstance(error.__cause__, KeyError)


@pytest.mark.parametrize(
    ("hook", "bad"),
    [("should_run_mtp", "yes"), ("mtp_loss_scale", -1.0), ("mtp_objective", "js")],
)
def test_a_plugins_bad_answer_names_the_plugin_and_the_hook(hook, bad):
    answers(hook, bad, name="odd")
    with pytest.raises(PolicyError) as info:
        mtp_hooks.decide(Model(), "train")
    assert (info.value.plugin, info.value.hook, info.value.phase) == ("odd", hook, "train")


def test_a_conflict_carries_each_plugins_answer():
    answers("should_run_mtp", True, name="runs")
    answers("should_run_mtp", False, name="skips")
    answers("should_run_mtp", None, name="abstains")
    with pytest.raises(PolicyConflictError) as info:
        mtp_hooks.decide(Model(), "rollout")
    assert dict(info.value.answers) == {"runs": True, "skips": False}
    assert (info.value.hook, info.value.phase) == ("should_run_mtp", "rollout")


def test_a_weight_conflict_carries_each_plugins_weight():
    answers("mtp_loss_scale", 0.1, name="low")
    answers("mtp_loss_scale", 0.5, name="high")
    with pytest.raises(PolicyConflictError) as info:
        mtp_hooks.decide(Model(), "train")
    assert dict(info.value.answers) == {"high": 0.5, "low": 0.1}
    assert info.value.hook == "mtp_loss_scale"


def test_unregistering_an_unknown_name_names_it():
    with pytest.raises(UnknownPluginError) as info:
        mtp_hooks.plugins.unregister("nobody")
    assert info.value.plugin == "nobody"


def test_a_plugin_refused_at_registration_is_named():
    class Wrapper:
        @mtp_hooks.plugins.hookimpl(wrapper=True)
        def should_run_mtp(self, model, phase):
            return (yield)

    with pytest.raises(PluginError) as info:
        mtp_hooks.plugins.register(Wrapper(), name="wrapping")
    assert (info.value.plugin, info.value.hook) == ("wrapping", "should_run_mtp")


def test_the_attributes_survive_pickling_as_a_worker_process_sends_them():
    with pytest.raises(PolicyError) as info:
        mtp_hooks.configure("eval=skp,rolout=skip")
    copy = pickle.loads(pickle.dumps(info.value))
    assert type(copy) is PolicyError and str(copy) == str(info.value)
    assert attributes(copy) == attributes(info.value)
    assert [attributes(e) for e in copy.errors] == [attributes(e) for e in info.value.errors]


def test_a_conflict_survives_pickling_with_each_plugins_answer():
    answers("should_run_mtp", True, name="runs")
    answers("should_run_mtp", False, name="skips")
    with pytest.raises(PolicyConflictError) as info:
        mtp_hooks.decide(Model(), "eval")
    copy = pickle.loads(pickle.dumps(info.value))
    assert dict(copy.answers) == {"runs": True, "skips": False} and copy.phase == "eval"


def test_an_outer_caller_fills_only_what_the_error_left_unknown():
    error = PolicyError("x", phase="eval")
    error.fill(phase="train", role="teacher")
    assert (error.phase, error.role) == ("eval", "teacher")
    with pytest.raises(TypeError, match="unknown attribute 'colour'"):
        error.fill(colour="red")


def test_the_user_guides_example_prints_what_its_comment_says(capsys):
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[2] / "docs" / "user-guide.md").read_text()
    section = guide[guide.index("### Errors a framework can act on") :]
    code = section[section.index("```python\n") + 10 : section.index("```\n", 10)]
    exec(compile(code, "user-guide.md", "exec"), {})
    said = code.split("# ")[-1].strip().split(" / ")
    assert capsys.readouterr().out.splitlines() == said

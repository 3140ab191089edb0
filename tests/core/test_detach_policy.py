"""Detaching MTP in the policy (``+detach``) and from plugins: how the config and plugins
combine. Its syntax and checks, which every flag option shares, are in test_policy_options.py."""

from __future__ import annotations

import pytest

import mtp_hooks
from mtp_hooks import cli

from plugin_answers import answers


def test_a_plugin_detaches_when_the_config_does_not_say():
    answers("mtp_detach_heads", True, name="drafter")
    decision = mtp_hooks.decide(None, "train")
    assert (decision.options.detach, decision.options.by("detach")) == (True, "drafter")
    mtp_hooks.configure({"train": {"mtp": "run", "detach": False}})  # the config settles it
    assert mtp_hooks.decide(None, "train").options.detach is False


def test_plugins_that_abstain_or_say_false_leave_the_models_own_setting():
    answers("mtp_detach_heads", None, name="quiet")
    answers("mtp_detach_heads", False, name="no")
    decision = mtp_hooks.decide(None, "train")
    assert (decision.options.detach, decision.options.by("detach")) == (False, None)


def test_a_skip_never_detaches():
    answers("mtp_detach_heads", True, name="drafter")
    mtp_hooks.configure("eval=skip")
    assert mtp_hooks.decide(None, "eval").options.detach is False


def test_plugins_that_disagree_on_detaching_raise_a_conflict_naming_both():
    answers("mtp_detach_heads", True, name="a")
    answers("mtp_detach_heads", False, name="b")
    with pytest.raises(mtp_hooks.PolicyConflictError, match=r"a=True, b=False.*run\+detach"):
        mtp_hooks.decide(None, "train")
    assert "CONFLICT" in mtp_hooks.explain(None, "train")


@pytest.mark.parametrize(
    ("answer", "error", "message"),
    [
        ("yes", mtp_hooks.PolicyError, "plugin 'bad': mtp_detach_heads returned 'yes'"),
        (KeyError("k"), mtp_hooks.PluginError, "'bad': mtp_detach_heads raised KeyError"),
    ],
)
def test_a_bad_plugin_answer_names_the_plugin(answer, error, message):
    answers("mtp_detach_heads", answer, name="bad")
    with pytest.raises(error, match=message):
        mtp_hooks.decide(None, "train")


def test_a_plugin_answer_is_asked_again_at_every_decision():
    plugin = answers("mtp_detach_heads", True)
    mtp_hooks.plugins.register(plugin, name="drafter")
    assert mtp_hooks.decide(None, "train").options.detach is True
    plugin.value = None  # no votes_changed(): an answer may follow the drafter's acceptance
    assert mtp_hooks.decide(None, "train").options.detach is False


def test_explain_and_check_config_show_detach(tmp_path, capsys):
    mtp_hooks.configure("train=run:0.3+detach")
    text = mtp_hooks.explain(None, "train")
    assert "detach: MTP trains on detached trunk outputs, embeddings and output weight" in text
    assert text.endswith("(from config)")
    path = tmp_path / "policy.toml"
    path.write_text(
        '[policy]\ntrain = {mtp = "run", metrics = true, detach = true}\n'
        'eval = {mtp = "run", detach = false}\n'
    )
    code = cli.main(["check-config", str(path)])
    out, err = capsys.readouterr()
    # 1 only where the megatron-core installed here would refuse +detach at attach
    assert code == 0 or "no mtp_detach_heads field" in err, err
    assert "train = run+metrics+detach" in out
    assert "eval = run (detach = false: the model's own)" in out

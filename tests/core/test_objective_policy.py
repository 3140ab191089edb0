"""The MTP objective in the policy (``+objective:kl``, TOML ``objective``, ``temperature``):
syntax, validation and what the decision carries."""

from __future__ import annotations

import pytest

import mtp_hooks
from mtp_hooks import _policy_entry

from plugin_answers import answers


@pytest.mark.parametrize(
    ("policy", "objective", "temperature"),
    [
        ("train=run+detach+objective:kl", "kl", 1.0),
        ("train = RUN + objective : TV + detach", "tv", 1.0),
        ("train=run:0.3+objective:kl+metrics+detach", "kl", 1.0),
        ({"train": {"mtp": "run", "detach": True, "objective": "kl"}}, "kl", 1.0),
        (
            {"train": {"mtp": "run", "detach": True, "objective": "tv", "temperature": 0.5}},
            "tv",
            0.5,
        ),
        ({"train": {"mtp": "auto", "detach": True, "objective": "kl", "temperature": 2}}, "kl", 2),
    ],
)
def test_an_objective_rides_on_a_detached_run_in_any_order_and_form(policy, objective, temperature):
    mtp_hooks.configure(policy)
    decision = mtp_hooks.decide(None, "train")
    assert (decision.run, decision.options.detach) == (True, True)
    assert (decision.options.objective, decision.options.temperature) == (objective, temperature)
    assert mtp_hooks.decide(None, "eval").options.objective is None


def test_ce_is_megatrons_own_loss_and_needs_no_detach():
    mtp_hooks.configure("train=run+objective:ce")
    decision = mtp_hooks.decide(None, "train")
    assert decision.run and decision.options.objective is None and not decision.options.detach


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ("train=run+objective:kl", r"write 'run\+detach\+objective:kl'"),
        ({"train": {"mtp": "run", "objective": "tv"}}, r"write 'run\+detach\+objective:tv'"),
        ({"train": {"mtp": "run", "detach": False, "objective": "kl"}}, "never train the trunk"),
        ("train=skip+objective:kl", r"'\+objective:kl' needs MTP to run"),
        ("train=run+detach+objective:js", "unknown MTP objective 'js'"),
        ("train=run+detach+objective", r"unknown option '\+objective'"),
        ("train=run+detach+objective:kl+objective:tv", r"give '\+objective' once"),
        ({"train": {"mtp": "run", "temperature": 0.5}}, "'temperature' is the temperature of"),
        (
            {"train": {"mtp": "run", "detach": True, "objective": "ce", "temperature": 0.5}},
            "'temperature' is the temperature of",
        ),
        (
            {"train": {"mtp": "run", "detach": True, "objective": "kl", "temperature": 0}},
            "finite and above 0",
        ),
        (
            {"train": {"mtp": "run", "detach": True, "objective": "kl", "temperature": True}},
            "'temperature' is a number",
        ),
        (
            {"train": {"mtp": "run", "detach": True, "objective": "kl", "temperature": "1"}},
            "'temperature' is a number",
        ),
        ({"train": {"mtp": "run", "detach": True, "objective": 3}}, "unknown MTP objective 3"),
    ],
)
def test_a_bad_objective_is_refused_naming_the_fix_and_the_policy_stays(policy, message):
    mtp_hooks.configure("train=run")
    with pytest.raises(mtp_hooks.PolicyError, match=message):
        mtp_hooks.configure(policy)
    decision = mtp_hooks.decide(None, "train")
    assert decision.run and decision.options.objective is None and not decision.options.detach


def test_an_objective_spells_back_in_the_compact_grammar():
    mtp_hooks.configure("train=run:0.5+detach+objective:tv")
    entry = mtp_hooks._sources.lookup(None, "train")
    assert entry is not None
    spelled = _policy_entry.spell(entry)
    assert spelled == "run:0.5+detach+objective:tv"
    mtp_hooks.configure(f"train={spelled}")
    assert mtp_hooks.decide(None, "train").options.objective == "tv"


def test_a_plugin_chooses_the_objective_where_the_config_names_none():
    answers("mtp_detach_heads", True, name="drafter")
    sampler = answers("mtp_objective", "kl", name="sampler")
    mtp_hooks.configure("train=run")
    decision = mtp_hooks.decide(None, "train")
    assert (
        decision.options.objective,
        decision.options.by("objective"),
        decision.options.temperature,
    ) == (
        "kl",
        "sampler",
        1.0,
    )
    sampler.value = "ce"
    assert mtp_hooks.decide(None, "train").options.objective is None
    mtp_hooks.configure("train=run+detach+objective:tv")  # the config names one: not asked
    calls = len(sampler.calls)
    assert mtp_hooks.decide(None, "train").options.by("objective") == "config"
    assert len(sampler.calls) == calls
    assert "from config" in mtp_hooks.explain(None, "train")


def test_plugins_that_disagree_on_the_objective_raise_a_conflict_naming_both():
    answers("mtp_detach_heads", True, name="drafter")
    answers("mtp_objective", "kl", name="a")
    answers("mtp_objective", "tv", name="b")
    mtp_hooks.configure("train=run")
    with pytest.raises(mtp_hooks.PolicyConflictError, match="a=kl, b=tv"):
        mtp_hooks.decide(None, "train")


@pytest.mark.parametrize("bad", ["KL", "js", 1, True])
def test_a_plugin_objective_outside_ce_kl_tv_is_refused_naming_the_plugin(bad):
    answers("mtp_objective", bad, name="odd")
    mtp_hooks.configure("train=run")
    with pytest.raises(mtp_hooks.PolicyError, match="plugin 'odd': mtp_objective returned"):
        mtp_hooks.decide(None, "train")


def test_a_plugin_objective_on_an_undetached_forward_is_refused_naming_the_fix():
    answers("mtp_objective", "tv", name="sampler")
    mtp_hooks.configure("train=run")
    with pytest.raises(mtp_hooks.PolicyError, match=r"plugin sampler .* not detached\. Detach"):
        mtp_hooks.decide(None, "train")


def test_explain_names_the_objective_its_temperature_and_its_source():
    mtp_hooks.configure(
        {"train": {"mtp": "run", "detach": True, "objective": "kl", "temperature": 0.5}}
    )
    text = mtp_hooks.explain(None, "train")
    assert (
        "objective: kl against the policy's own next-token distribution at temperature 0.5" in text
    )
    assert "from config" in text and "at weight 0" in text

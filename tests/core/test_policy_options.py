"""Each policy option is declared once (``mtp_hooks._policy_entry.OPTIONS``): the parser, its
messages, ``check-config``'s spelling and the fields of entries, decisions and plans follow
from the declarations."""

from __future__ import annotations

import dataclasses

import pytest

import mtp_hooks
from mtp_hooks import _decision, _policy, _policy_entry
from mtp_hooks._policy_entry import OPTIONS

ENTRY_BOOKKEEPING = {"value", "source"}
DECISION_BOOKKEEPING = {"run", "kind", "voters", "votes", "phase", "role", "source"}


def declared(fields: str) -> list[str]:
    return [name for option in OPTIONS for name in getattr(option, fields)]


def test_every_entry_field_beyond_the_value_is_declared_by_exactly_one_option():
    entry = {f.name for f in dataclasses.fields(_policy_entry.PolicyEntry)}
    assert sorted(declared("entry_fields")) == sorted(entry - ENTRY_BOOKKEEPING)


def test_every_decision_field_beyond_who_decided_is_declared_by_exactly_one_option():
    decision = {f.name for f in dataclasses.fields(_decision.Decision)}
    assert sorted(declared("decision_fields")) == sorted(decision - DECISION_BOOKKEEPING)


def test_every_plan_field_is_declared_once():
    fields = [field.field for field in _policy_entry.plan_fields()]
    assert len(fields) == len(set(fields))


@pytest.mark.parametrize("option", OPTIONS, ids=lambda o: o.name)
def test_an_option_left_out_sets_exactly_its_own_fields_and_nothing_else(option):
    fields = option.parse({}, "here", "run", {"detach": None})
    assert set(fields) == set(option.entry_fields)
    defaults = {f.name: f.default for f in dataclasses.fields(_policy_entry.PolicyEntry)}
    assert fields == {name: defaults[name] for name in fields}  # what an entry holds unset


def test_every_table_key_belongs_to_one_option():
    keys = declared("keys")
    assert len(keys) == len(set(keys)) and "mtp" not in keys


# -- a made-up option, declared once ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class EntryWithEcho(_policy_entry.PolicyEntry):
    echo: bool | None = None


ECHO = _policy_entry.flag_option("echo", decision_fields=())
"""docs/contributing.md's made-up flag (in the docs it also adds a decision field)."""


@pytest.fixture
def with_echo(monkeypatch):
    """The options with one more, as docs/contributing.md's example adds it: its declaration,
    and the entry field it sets."""
    monkeypatch.setattr(_policy_entry, "OPTIONS", (*OPTIONS, ECHO))
    monkeypatch.setattr(_policy, "PolicyEntry", EntryWithEcho)


def test_a_new_option_is_parsed_spelled_and_listed_from_its_declaration_alone(with_echo):
    (entry,) = _policy.parse_policy("train=run:0.3+echo+detach").values()
    assert entry.echo is True and entry.detach is True and entry.loss_scale == 0.3
    assert _policy_entry.spell(entry) == "run:0.3+detach+echo"
    (table,) = _policy.parse_policy({"train": {"mtp": "run", "echo": True}}).values()
    assert table.echo is True
    assert "'+echo'" in _policy_entry.allowed_values()
    assert "echo" in _policy_entry.table_keys()


def test_a_new_option_gets_the_parsers_checks_and_hints(with_echo):
    with pytest.raises(mtp_hooks.PolicyError, match=r"'\+echo' needs MTP to run") as skipped:
        _policy.parse_policy("eval=skip+echo")
    assert skipped.value.option == "+echo" and skipped.value.phase == "eval"
    with pytest.raises(mtp_hooks.PolicyError, match=r"did you mean '\+echo'\?.*'\+echo'"):
        _policy.parse_policy("train=run+ecko")
    with pytest.raises(mtp_hooks.PolicyError, match=r"did you mean 'echo'\?.*'echo'"):
        _policy.parse_policy({"train": {"mtp": "run", "ecko": True}})
    with pytest.raises(mtp_hooks.PolicyError, match="'echo' is true or false"):
        _policy.parse_policy({"train": {"mtp": "run", "echo": "yes"}})


def test_every_option_has_its_step_in_the_decision_and_nothing_else_does():
    assert list(_decision.STEPS) == [option.name for option in OPTIONS]


FLAGS = [option.name for option in OPTIONS if option.shown and not option.choices]


def malformed(flag: str) -> list[tuple[object, str]]:
    """Each way a flag option can be given wrong, and what the error says."""
    return [
        (f"train=skip+{flag}", rf"key 'train': '\+{flag}' needs MTP to run; write 'run\+{flag}'"),
        (f"train=run+{flag}+{flag}", rf"give '\+{flag}' once"),
        (f"train=run:0.3+{flag}+mask:labels+{flag}", rf"give '\+{flag}' once"),
        (f"train=run+{flag}ed", rf"unknown option '\+{flag}ed' \(did you mean '\+{flag}'\?\): "),
        ({"train": {"mtp": "skip", flag: True}}, rf"'\+{flag}' needs MTP to run"),
        ({"train": {"mtp": "run", flag: "yes"}}, f"'{flag}' is true or false, not 'yes'"),
        ({"train": {"mtp": f"run+{flag}"}}, "a table takes 'mtp'"),
    ]


@pytest.mark.parametrize(
    ("policy", "message"), [case for flag in FLAGS for case in malformed(flag)]
)
def test_a_flag_option_given_wrong_is_a_policy_error_that_changes_nothing(policy, message):
    mtp_hooks.configure("train=run:0.5+mask:labels")
    before = mtp_hooks.decide(None, "train")
    with pytest.raises(mtp_hooks.PolicyError, match=message) as info:
        mtp_hooks.configure(policy)
    assert "mtp_hooks.configure()" in str(info.value)
    assert mtp_hooks.decide(None, "train") == before


def well_formed(flag: str) -> list[tuple[str, object, float | None]]:
    """Each way a flag option rides on ``run``, and the loss weight it comes with."""
    return [
        (flag, f"train=run+{flag}", None),
        (flag, f"train = RUN + {flag}", None),
        (flag, f"train=run:0.3+{flag}+mask:labels", 0.3),
        (flag, f"train=run:0.3+mask:labels+{flag}", 0.3),
        (flag, {"train": {"mtp": "run", flag: True}}, None),
        (flag, {"train": {"mtp": "run", "loss_scale": 0.3, flag: True}}, 0.3),
    ]


@pytest.mark.parametrize(
    ("flag", "policy", "loss_scale"), [case for flag in FLAGS for case in well_formed(flag)]
)
def test_a_flag_option_rides_on_run_in_any_order_and_form_and_in_its_phase_only(
    flag, policy, loss_scale
):
    mtp_hooks.configure(policy)
    decision = mtp_hooks.decide(None, "train")
    assert (decision.run, getattr(decision, flag), decision.loss_scale) == (True, True, loss_scale)
    by = [f for f in _policy_entry.by_name(flag).decision_fields if f.endswith("_by")]
    assert [getattr(decision, f) for f in by] == ["config"] * len(by)
    assert getattr(mtp_hooks.decide(None, "eval"), flag) is False


@pytest.mark.parametrize("flag", FLAGS)
def test_auto_with_a_flag_option_sets_it_only_when_the_plugins_run_mtp(voter, flag):
    mtp_hooks.configure(f"train=auto+{flag}")
    plugin = voter(True, name="v")
    assert getattr(mtp_hooks.decide(None, "train"), flag) is True
    plugin.value = False
    mtp_hooks.configure(f"train=auto+{flag}")  # a new generation: decide again
    decision = mtp_hooks.decide(None, "train")
    assert (decision.run, getattr(decision, flag)) == (False, False)


def test_the_hook_an_option_names_is_a_hook_of_the_library():
    from mtp_hooks import hookspecs

    hooks = [option.hook for option in OPTIONS if option.hook is not None]
    assert hooks and all(callable(getattr(hookspecs, hook, None)) for hook in hooks)

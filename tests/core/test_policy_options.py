"""Each policy option is declared once (``mtp_hooks._policy_entry.OPTIONS``): the parser, its
messages, ``check-config``'s spelling and the fields of entries, decisions and plans follow
from the declarations."""

from __future__ import annotations

import dataclasses

import pytest

import mtp_hooks
from mtp_hooks import _decision, _policy, _policy_entry
from mtp_hooks._policy_entry import OPTIONS, PlanField, PolicyOption

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


def _echo(table, where, value, parsed):
    flag = table.get("echo")
    if flag is not None and not isinstance(flag, bool):
        raise mtp_hooks.PolicyError(f"{where}: 'echo' is true or false, not {flag!r}")
    _policy_entry.needs_a_run("echo", flag, where, value)
    return {"echo": flag}


ECHO = PolicyOption(
    name="echo",
    shown="'+echo'",
    choices=(),
    keys=("echo",),
    parse=_echo,
    spell=lambda e: "+echo" if e.echo else "",
    entry_fields=("echo",),
    decision_fields=(),
    plan=(PlanField("echo", False, "+echo"),),
)


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

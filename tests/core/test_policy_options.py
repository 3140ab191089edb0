"""Each policy option is one class (``mtp_hooks._options``): the parser, its messages,
``check-config``'s spelling, the decision, the plan and ``explain`` follow from it, and
entries, decisions and plans carry every option's fields in one record."""

from __future__ import annotations

import pytest

import mtp_hooks
from mtp_hooks import _options, _policy, _policy_entry
from mtp_hooks._options import OPTIONS


def declared(fields: str) -> list[str]:
    return [name for option in OPTIONS for name in getattr(option, fields)]


def test_every_entry_field_is_declared_by_exactly_one_option():
    assert sorted(declared("given")) == sorted(set(declared("given")))
    assert list(_options.entry_options().fields()) == declared("given")


def test_every_decision_and_plan_field_is_declared_by_exactly_one_option():
    assert sorted(declared("decided")) == sorted(set(declared("decided")))
    assert list(_options.plain().fields()) == declared("decided")
    assert mtp_hooks.decide(None, "train").options == _options.plain()


@pytest.mark.parametrize("option", OPTIONS, ids=lambda o: o.name)
def test_an_option_left_out_sets_exactly_its_own_fields_and_nothing_else(option):
    fields = option.parse({}, "here", "run", {"detach": None})
    assert fields == dict(option.given)  # what an entry holds unset


def test_every_table_key_belongs_to_one_option():
    keys = declared("keys")
    assert len(keys) == len(set(keys)) and "mtp" not in keys


def test_reading_a_field_no_option_declares_names_the_fields_with_a_hint():
    options = mtp_hooks.decide(None, "train").options
    with pytest.raises(AttributeError, match=r"'detatch' \(did you mean 'detach'\?\).*loss_scale"):
        options.detatch  # noqa: B018
    with pytest.raises(AttributeError, match="immutable"):
        options.detach = True


def test_the_options_record_pickles_copies_and_compares_by_value():
    import copy
    import pickle

    mtp_hooks.configure("train=run:0.3+detach")
    options = mtp_hooks.decide(None, "train").options
    for twin in (pickle.loads(pickle.dumps(options)), copy.deepcopy(options)):
        assert twin == options and hash(twin) == hash(options)
        assert (twin.loss_scale, twin.by("detach")) == (0.3, "config")


# -- a made-up option, one class ----------------------------------------------------------------


class Echo(_options.Flag):
    """docs/contributing.md's made-up flag: ``+echo``, which asks for an extension of its own."""

    name = "echo"

    def plan(self, options, implements):
        return _options.PlanPart(extension=True) if options.echo else _options.NOTHING

    def describe(self, options, implementers):
        return ["echo: the MTP loss is logged"] * options.echo


@pytest.fixture
def with_echo(monkeypatch):
    """The options with one more, as docs/contributing.md's example adds it: its class."""
    monkeypatch.setattr(_options, "OPTIONS", (*OPTIONS, Echo()))


def test_a_new_option_is_parsed_spelled_and_listed_from_its_class_alone(with_echo):
    (entry,) = _policy.parse_policy("train=run:0.3+echo+detach").values()
    options = entry.options
    assert options.echo is True and options.detach is True and options.loss_scale == 0.3
    assert _policy_entry.spell(entry) == "run:0.3+detach+echo"
    (table,) = _policy.parse_policy({"train": {"mtp": "run", "echo": True}}).values()
    assert table.options.echo is True
    assert "'+echo'" in _policy_entry.allowed_values()
    assert "echo" in _policy_entry.table_keys()


def test_a_new_option_is_decided_and_explained_from_its_class_alone(with_echo):
    mtp_hooks.configure("train=run+echo")
    decision = mtp_hooks.decide(None, "train")
    assert (decision.options.echo, decision.options.by("echo")) == (True, "config")
    assert mtp_hooks.decide(None, "eval").options.echo is False
    assert "echo: the MTP loss is logged" in mtp_hooks.explain(None, "train")
    assert "echo" not in mtp_hooks.explain(None, "eval")


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
    options = decision.options
    assert (decision.run, getattr(options, flag), options.loss_scale) == (True, True, loss_scale)
    assert options.by(flag) == "config"
    assert getattr(mtp_hooks.decide(None, "eval").options, flag) is False


@pytest.mark.parametrize("flag", FLAGS)
def test_auto_with_a_flag_option_sets_it_only_when_the_plugins_run_mtp(voter, flag):
    mtp_hooks.configure(f"train=auto+{flag}")
    plugin = voter(True, name="v")
    assert getattr(mtp_hooks.decide(None, "train").options, flag) is True
    plugin.value = False
    mtp_hooks.configure(f"train=auto+{flag}")  # a new generation: decide again
    decision = mtp_hooks.decide(None, "train")
    assert (decision.run, getattr(decision.options, flag)) == (False, False)


def test_the_hook_an_option_names_is_a_hook_of_the_library():
    from mtp_hooks import hookspecs

    hooks = [option.hook for option in OPTIONS if option.hook is not None]
    assert hooks and all(callable(getattr(hookspecs, hook, None)) for hook in hooks)

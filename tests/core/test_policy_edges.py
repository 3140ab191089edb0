"""The policy grammar, weights, the controller and schedules at their edges: each input is the
documented parse or a ``PolicyError`` naming the fix, never a silent change."""

from __future__ import annotations

import math
import re

import pytest

import mtp_hooks
from mtp_hooks import PolicyError
from mtp_hooks._policy import parse_policy
from mtp_hooks._policy_entry import spell
from mtp_hooks.framework import loss_scale_schedule

from plugin_answers import answers


def weight(policy) -> float | None:
    return parse_policy(policy)[(None, "train")].options.loss_scale


@pytest.mark.parametrize(
    "table",
    [
        {"mtp": "run:0.3"},
        {"mtp": "run+detach"},
        {"mtp": "run+metrics", "loss_scale": 0.3},
        {"mtp": "auto:0.3"},
    ],
)
def test_a_table_whose_mtp_carries_a_weight_or_an_option_is_refused(table):
    with pytest.raises(PolicyError, match="with no weight or option in it"):
        parse_policy({"train": table})


def test_a_toml_table_whose_mtp_carries_a_weight_is_refused(tmp_path):
    path = tmp_path / "policy.toml"
    path.write_text('[policy]\ntrain = { mtp = "run:0.3" }\n')
    from mtp_hooks._policy import load_policy_file

    with pytest.raises(PolicyError, match="loss_scale"):
        load_policy_file(path)


@pytest.mark.parametrize(
    "policy",
    [
        {"train": {"mtp": "run", 1: True, "x": 2}},
        {"train": {"mtp": "run", None: 1, (1, 2): 3}},
        {1: "run", "eval": "skip"},
        {"roles": {"teacher": {1: "run", "eval": "skip"}}},
    ],
)
def test_a_mapping_with_keys_of_mixed_types_is_a_policy_error(policy):
    with pytest.raises(PolicyError):
        parse_policy(policy)


@pytest.mark.parametrize("scale", ["0.3", b"0.3", True, None, [0.3], complex(0.3)])
def test_a_weight_that_is_not_a_number_is_refused_from_plugins_and_tables(scale):
    if scale is not None:
        with pytest.raises(PolicyError, match="not a finite number"):
            parse_policy({"train": {"mtp": "run", "loss_scale": scale}})
    answers("mtp_loss_scale", scale, name="weigher")
    if scale is None:  # abstains
        assert mtp_hooks.decide(None, "train").options.loss_scale is None
        return
    with pytest.raises(PolicyError, match="weigher"):
        mtp_hooks.decide(None, "train")


def test_weights_given_as_numbers_of_any_real_type_are_taken():
    import fractions

    assert parse_policy({"train": {"mtp": "run", "loss_scale": fractions.Fraction(3, 10)}})[
        (None, "train")
    ].options.loss_scale == pytest.approx(0.3)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("run:1e+3", 1000.0),
        ("run:1E-1", 0.1),
        ("run:.5", 0.5),
        ("run:2.", 2.0),
        ("run: 0.3 +metrics", 0.3),
        ("run:0", 0.0),
        ("run:0e0", 0.0),
    ],
)
def test_the_weight_grammar_reads_what_the_docs_show(text, expected):
    assert weight(f"train={text}") == expected


@pytest.mark.parametrize(
    "text",
    [
        "run:-0",
        "run:-0.0",
        "run:+1",
        "run:١",
        "run:1_000",
        "run:inf",
        "run:nan",
        "run:0x10",
        "run:1e",
        "run:1e999",
        "run:",
        "run:0.3.1",
        "run:1 000",
    ],
)
def test_every_other_weight_spelling_is_a_policy_error(text):
    with pytest.raises(PolicyError, match="not a finite number >= 0|allowed values are"):
        parse_policy(f"train={text}")


def test_a_negative_zero_weight_from_a_plugin_becomes_zero():
    answers("mtp_loss_scale", -0.0, name="weigher")
    scale = mtp_hooks.decide(None, "train").options.loss_scale
    assert scale == 0.0 and math.copysign(1.0, scale) == 1.0


@pytest.mark.parametrize("step", [math.nan, -1, "5", None, True, 2.0])
def test_a_schedule_step_that_is_not_an_int_of_at_least_zero_is_refused(step):
    with pytest.raises(PolicyError, match="is not an int >= 0"):
        loss_scale_schedule({0: 0.3, 10: 0.1}, step)


def test_a_schedule_weight_given_as_a_string_is_refused():
    with pytest.raises(PolicyError, match="not a finite number"):
        loss_scale_schedule({0: "0.3"}, 0)


@pytest.mark.parametrize(
    "policy, message",
    [
        ("train=skip+mask:labels", "'+mask:labels' needs MTP to run"),
        ("train=run+mask:padding", "unknown MTP loss mask source 'padding'"),
        ("train=run+mask", "unknown option '+mask'"),
        ("train=run+metrics:labels", "unknown option '+metrics:labels'"),
        ("train=run+mask:labels+mask:labels", "give '+mask' once"),
        ({"train": {"mtp": "run", "ignore_index": -1}}, 'add mask = "labels"'),
        ({"train": {"mtp": "run", "mask": "labels", "ignore_index": 1.5}}, "integer label"),
        ({"train": {"mtp": "run", "mask": "labels", "ignore_index": True}}, "integer label"),
        ({"train": {"mtp": "run", "plugin_masks": "no"}}, "'plugin_masks' is true or false"),
        ({"train": {"mtp": "run", "mask": "labels", "ignore_index": 2**64}}, "does not fit"),
        ({"train": {"mtp": "run", "mask": "labels", "ignore_index": 2**63}}, "does not fit"),
        ({"train": {"mtp": "run", "mask": "labels", "ignore_index": -(2**63) - 1}}, "not fit"),
        ({"train": {"mtp": "run", "mask": ["labels"]}}, "unknown MTP loss mask source"),
    ],
)
def test_a_malformed_mask_setting_is_a_policy_error_naming_it(policy, message):
    with pytest.raises(mtp_hooks.PolicyError, match=re.escape(message)):
        parse_policy(policy)


def test_mask_labels_spells_back_to_itself_with_any_other_option():
    for text in ("run+mask:labels", "run:0.3+metrics+detach+mask:labels", "auto+mask:labels"):
        (entry,) = parse_policy(f"train={text}").values()
        assert spell(entry) == text and entry.options.mask == "labels"


@pytest.mark.parametrize("ignore", [-(2**63), 2**63 - 1, -100, 0])
def test_an_ignore_index_anywhere_in_int64_is_taken(ignore):
    (entry,) = parse_policy(
        {"train": {"mtp": "run", "mask": "labels", "ignore_index": ignore}}
    ).values()
    assert entry.options.ignore_index == ignore


def test_an_ignore_index_beyond_int64_in_toml_is_refused_when_the_file_is_read(tmp_path):
    from mtp_hooks._policy import load_policy_file

    path = tmp_path / "big.toml"
    path.write_text(
        '[policy]\ntrain = {mtp = "run", mask = "labels", ignore_index = 18446744073709551616}\n'
    )
    with pytest.raises(mtp_hooks.MTPHooksError, match="does not fit the labels' int64"):
        load_policy_file(path)


def test_a_refused_ignore_index_leaves_the_policy_as_it_was():
    mtp_hooks.configure("train=skip")
    with pytest.raises(mtp_hooks.PolicyError, match="does not fit"):
        mtp_hooks.configure({"train": {"mtp": "run", "mask": "labels", "ignore_index": 2**64}})
    decision = mtp_hooks.decide(None, "train")
    assert not decision.run and decision.options.mask is None

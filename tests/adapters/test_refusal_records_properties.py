"""The user guide's promise about errors, as a property over the situations a forward can fail
in: "Every error also names its culprit in attributes, ``None`` where they do not apply:
``phase``, ``role``, ``option`` (...), ``source`` (...), ``plugin`` and ``hook``."

A situation is what the caller knows before the error comes: which plugin answered which hook,
badly or by raising, in which phase, on a model attached under which role, under a policy set
from which source with which bad entry. Whatever the error's type, its attributes must say
that situation back: a framework acts on them without reading the message. Hypothesis draws
the situations (a fixed seed, 40 examples a test) on real megatron-core models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

import mtp_hooks

from model_fixtures import guards_empty_masks, has_detach_field
from plugin_answers import answers

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SETTINGS = settings(
    max_examples=40,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)

# What each hook may answer that the library must refuse; None where any answer is accepted.
BAD_ANSWERS: dict[str, Any] = {
    "should_run_mtp": "yes",
    "mtp_loss_scale": -1.0,
    "mtp_objective": "js",
    "mtp_loss_mask": torch.ones(3),
    "mtp_metrics": None,
    "mtp_detach_heads": None,
}


def forward_hooks() -> list[str]:
    """The hooks a forward consults on this megatron-core."""
    hooks = ["should_run_mtp", "mtp_loss_scale", "mtp_objective", "mtp_metrics"]
    if guards_empty_masks():
        hooks.append("mtp_loss_mask")
    if has_detach_field():
        hooks.append("mtp_detach_heads")
    return hooks


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that fails in one hook during one forward: what the caller knows of it."""

    hook: str
    raises: bool
    phase: str
    role: str | None


plugin_failures = st.builds(
    PluginFailure,
    hook=st.sampled_from(forward_hooks()),
    raises=st.booleans(),
    phase=st.sampled_from(["train", "eval"]),
    role=st.sampled_from([None, "teacher", "student"]),
).filter(lambda failure: failure.raises or BAD_ANSWERS[failure.hook] is not None)


@SETTINGS
@given(failure=plugin_failures)
def test_a_plugin_failing_in_a_forward_is_named_with_its_hook_and_the_calls_phase_and_role(
    build, batch, failure
):
    mtp_hooks.testing.reset()
    model = build()
    mtp_hooks.attach(model, role=failure.role)
    if failure.hook == "mtp_metrics":  # asked only where the policy wants metrics
        mtp_hooks.configure(f"{failure.phase}=run+metrics")
    answer = RuntimeError("the plugin broke") if failure.raises else BAD_ANSWERS[failure.hook]
    answers(failure.hook, answer, name="culprit")
    model.train(failure.phase == "train")
    with torch.set_grad_enabled(failure.phase == "train"):
        with pytest.raises(mtp_hooks.MTPHooksError) as info:
            model(*batch.args(), labels=batch.labels)
    error = info.value
    assert (error.plugin, error.hook) == ("culprit", failure.hook), error
    assert (error.phase, error.role) == (failure.phase, failure.role), error
    assert error.source is None  # no policy source is at fault here


@dataclass(frozen=True)
class BadEntry:
    """One bad entry of a policy: the caller wrote it, so it knows every part of it."""

    role: str | None
    phase: str
    value: str
    option: str  # the part of ``value`` at fault
    from_environment: bool


BAD_VALUES = [("skp", "skp"), ("run+detatch", "+detatch"), ("run:abc", "run:abc")]

bad_entries = st.builds(
    lambda role, phase, value, env: BadEntry(role, phase, value[0], value[1], env),
    st.sampled_from([None, "teacher", "student"]),
    st.sampled_from(["train", "eval", "rollout"]),
    st.sampled_from(BAD_VALUES),
    st.booleans(),
)


@SETTINGS
@given(entry=bad_entries, good_before=st.booleans())
def test_a_bad_policy_entry_is_named_with_its_role_phase_option_and_source(
    build, monkeypatch, entry, good_before
):
    mtp_hooks.testing.reset()
    key = entry.phase if entry.role is None else f"{entry.role}.{entry.phase}"
    policy = f"{key}={entry.value}"
    if good_before:  # a valid entry beside it changes nothing of the bad one's record
        policy = f"train=run,{policy}" if entry.phase != "train" else f"eval=run,{policy}"
    model = build()
    if entry.from_environment:
        monkeypatch.setenv("MTP_HOOKS_POLICY", policy)
        source = f"MTP_HOOKS_POLICY={policy!r}"
        with pytest.raises(mtp_hooks.PolicyError) as info:
            mtp_hooks.attach(model, role=entry.role)
        monkeypatch.delenv("MTP_HOOKS_POLICY")
    else:
        source = "mtp_hooks.configure()"
        with pytest.raises(mtp_hooks.PolicyError) as info:
            mtp_hooks.configure(policy)
    error = info.value
    records = error.errors or (error,)
    assert len(records) == 1, records
    (record,) = records
    assert (record.role, record.phase, record.option) == (entry.role, entry.phase, entry.option)
    assert record.source == source
    assert (record.plugin, record.hook) == (None, None)  # no plugin took part

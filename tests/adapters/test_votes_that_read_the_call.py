"""A vote may read the forward call it decides (``should_run_mtp(model, phase, call)``).

Frameworks such as veRL say per call whether MTP trains, by what they pass. A vote that reads
the call decides each forward anew; one that does not is reused as before.
"""

from __future__ import annotations

import inspect

import torch

import mtp_hooks
from mtp_hooks import Phase
from mtp_hooks.demo import tiny_models
from mtp_hooks.framework import cacheable_vote
from mtp_hooks.plugins import hookimpl


class LabelsDecide:
    """Train MTP only in forwards that pass labels; skip it in eval without reading the call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    @hookimpl
    @cacheable_vote
    def should_run_mtp(self, model, phase, call):
        self.calls.append((str(phase), call))
        if phase != Phase.TRAIN:
            return False
        if call is None:
            return None
        return call.argument("labels") is not None


def mtp_runs(model, *args, **kwargs) -> int:
    ran = tiny_models.MTPForwards(model)
    try:
        model(*args, **kwargs)
    finally:
        ran.remove()
    return ran.n


def test_a_vote_that_reads_the_call_decides_each_forward_by_what_it_passed(build, batch):
    model = build()
    mtp_hooks.attach(model)
    plugin = LabelsDecide()
    mtp_hooks.plugins.register(plugin, name="labels")
    assert mtp_runs(model, *batch.args(), labels=batch.labels) == 1
    assert mtp_runs(model, *batch.args()) == 0
    assert mtp_runs(model, *batch.args(), labels=batch.labels) == 1
    assert [phase for phase, _ in plugin.calls] == ["train"] * 3  # asked at every forward


def test_arguments_passed_by_position_are_read_by_their_names(build, batch):
    model = build()
    mtp_hooks.attach(model)
    plugin = LabelsDecide()
    mtp_hooks.plugins.register(plugin, name="labels")
    names = list(inspect.signature(type(model).forward).parameters)[1:]
    before_labels = [None] * (names.index("labels") - len(batch.args()))
    assert mtp_runs(model, *batch.args(), *before_labels, batch.labels) == 1
    (_, call), *_ = plugin.calls
    assert torch.equal(call.argument("labels"), batch.labels)
    assert call.argument("input_ids") is batch.input_ids
    assert call.argument("no_such_argument", "absent") == "absent"


def test_a_vote_that_does_not_read_the_call_is_still_reused(build, batch):
    model = build()
    mtp_hooks.attach(model)
    plugin = LabelsDecide()
    mtp_hooks.plugins.register(plugin, name="labels")
    model.eval()
    with torch.no_grad():
        assert [mtp_runs(model, *batch.args(), labels=batch.labels) for _ in range(3)] == [0] * 3
    assert [phase for phase, _ in plugin.calls] == ["eval"]  # asked once: the call unread


def test_outside_a_forward_the_call_is_none(build):
    model = build()
    plugin = LabelsDecide()
    mtp_hooks.plugins.register(plugin, name="labels")
    decision = mtp_hooks.decide(model, "train")
    assert plugin.calls == [("train", None)]
    assert (decision.run, decision.kind) == (True, "default")  # it abstained without a call
    assert "labels: abstain" in mtp_hooks.explain(model, "train")


def test_plugins_that_name_no_call_argument_are_called_as_before(build, batch, voter):
    model = build()
    mtp_hooks.attach(model)
    old_style = voter(False, "old-style")  # should_run_mtp(self, model, phase)
    assert mtp_runs(model, *batch.args(), labels=batch.labels) == 0
    assert len(old_style.calls) == 1

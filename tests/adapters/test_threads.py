"""Forwards in several threads: each gets its own decision, or a clear error, never a swap.

The MTP gates are attributes of the model, shared by every thread. A forward that would change
them while another thread's forward of the same model runs raises ``MTPHooksError``; forwards
that agree on leaving them alone run together.
"""

from __future__ import annotations

import pytest
import torch

import mtp_hooks

from model_fixtures import Paused, forward_in, native


@pytest.mark.parametrize("first,second", [("rollout", "eval"), ("eval", "rollout")])
def test_a_second_thread_that_needs_the_other_decision_gets_a_clear_error(
    build, batch, count_mtp, first, second
):
    model = build()
    shared = model.config
    counter = count_mtp(model)
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("eval=run,rollout=skip")
    paused = Paused(model, batch, first)
    with pytest.raises(mtp_hooks.MTPHooksError, match="another thread"):
        forward_in(model, batch, second)
    paused.finish()
    expected = (True, True) if first == "eval" else (False, False)
    assert paused.seen == [expected, expected]  # the first thread's decision held throughout
    assert counter.n == (1 if first == "eval" else 0)
    assert model.mtp_process is True and model.config is shared
    assert handle.gates[0].records == []


def test_threads_that_all_run_mtp_share_the_model(build, batch, count_mtp):
    model = build()
    counter = count_mtp(model)
    mtp_hooks.attach(model)
    mtp_hooks.configure("eval=run")
    paused = Paused(model, batch, "eval")
    forward_in(model, batch, "eval")
    paused.finish()
    assert paused.seen == [(True, True), (True, True)] and counter.n == 2


def test_two_threads_on_two_models_each_get_their_own_decision(build, batch, count_mtp):
    first, second = build(seed=1), build(seed=2)
    counters = count_mtp(first), count_mtp(second)
    mtp_hooks.attach(first)
    mtp_hooks.attach(second)
    mtp_hooks.configure("eval=run,rollout=skip")
    paused = Paused(first, batch, "rollout")
    second.eval()
    forward_in(second, batch, "eval")
    paused.finish()
    assert paused.seen == [(False, False), (False, False)]
    assert (counters[0].n, counters[1].n) == (0, 1)


def test_the_native_flag_path_refuses_a_conflicting_thread_too(build, kind, batch):
    model = build(model_cls=native(kind))
    mtp_hooks.attach(model)
    mtp_hooks.configure("eval=run,rollout=skip")
    paused = Paused(model, batch, "rollout")
    with pytest.raises(mtp_hooks.MTPHooksError, match="another thread"):
        forward_in(model, batch, "eval")
    paused.finish()
    assert [flag for flag, _, _ in model.received] == [False]


class AlwaysMissing(dict):
    """A counts dict whose get() misses, as it does for every thread that reads it before the
    first one has stored the phase's counters."""

    def get(self, key, default=None):
        return default


def test_threads_deciding_a_new_phase_at_once_count_into_one_list(build, batch):
    model = build()
    handle = mtp_hooks.attach(model)
    gate = handle.gates[0]
    gate.counts = AlwaysMissing()
    first, second = gate.counters("eval"), gate.counters("eval")
    assert first is second  # with get-then-assign, the second thread replaced the first's list
    mtp_hooks.configure("eval=run")
    model.eval()
    with torch.no_grad():
        model(*batch.args(), labels=batch.labels)
    assert handle.stats() == {"eval": {"run": 1}} and first == [1, 0, 0, 0, 0]

"""Forwards in several threads: each gets its own decision, or a clear error, never a swap.

The MTP gates are attributes of the model, shared by every thread. A forward that would change
them while another thread's forward of the same model runs raises ``MTPHooksError``; forwards
that agree on leaving them alone run together.
"""

from __future__ import annotations

import sys
import threading
import traceback
import weakref

import pytest
import torch

import mtp_hooks
from mtp_hooks import _runtime

from model_fixtures import THREAD_TIMEOUT, Held, Paused, forward_in, native


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
    plans = handle.gates[0].plans
    plans.counts = AlwaysMissing()
    first, second = plans.counters("eval"), plans.counters("eval")
    assert first is second  # with get-then-assign, the second thread replaced the first's list
    mtp_hooks.configure("eval=run")
    model.eval()
    with torch.no_grad():
        model(*batch.args(), labels=batch.labels)
    assert handle.stats() == {"eval": {"run": 1}} and first == [1, 0, 0, 0, 0]


def held_entering(model, batch, where: str) -> Held:
    """Holds ``model``'s next evaluation in another thread just after torch has listed the
    hooks it will call, ``where`` it lists them (``"pre"``: before the forward, ``"post"``:
    after it), until released: a global hook runs first from that list."""
    from torch.nn.modules import module as torch_module

    register = {
        "pre": torch_module.register_module_forward_pre_hook,
        "post": torch_module.register_module_forward_hook,
    }[where]

    def place(hold):
        return register(lambda module, *rest: hold() if module is model else None)

    return Held(model, batch, "eval", place)


def test_remove_while_another_threads_forward_is_entering_leaves_that_forward_ungated(
    build, batch, count_mtp
):
    model = build()
    counter = count_mtp(model)
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("eval=skip")
    entering = held_entering(model, batch, "pre")  # torch has listed the gate's pre-hook
    handle.remove()
    entering.finish()  # the pre-hook it listed is gone: megatron's own forward, MTP runs
    assert counter.n == 1 and handle.stats() == {}
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_a_forward_that_listed_the_restoring_hook_after_it_went_ends_cleanly(
    build, batch, count_mtp
):
    model = build()
    counter = count_mtp(model)
    shared = model.config
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("eval=run")
    running = Paused(model, batch, "eval")  # in flight: the restoring hook stays for it
    handle.remove()
    entering = held_entering(model, batch, "post")  # ran ungated, then listed the restoring hook
    running.finish()  # the last forward in flight ends: the restoring hook goes
    entering.finish()
    assert counter.n == 2 and model.mtp_process is True and model.config is shared
    assert not model._forward_pre_hooks and not model._forward_hooks


def auto_attached(build) -> torch.nn.Module:
    mtp_hooks.auto_attach()
    try:
        return build()  # watched: its first forward attaches it
    finally:
        mtp_hooks.auto_attach(False)


def test_a_first_forward_begun_before_another_thread_attached_the_model_is_refused_clearly(
    build, batch, count_mtp
):
    model = auto_attached(build)
    counter = count_mtp(model)
    mtp_hooks.configure("eval=skip")
    entering = held_entering(model, batch, "pre")  # torch has listed the first-forward hook
    forward_in(model, batch, "eval")  # this thread's first forward attaches the model
    with pytest.raises(mtp_hooks.MTPHooksError, match="first forward began in two threads"):
        entering.finish()
    assert counter.n == 0 and mtp_hooks.attach(model).stats() == {"eval": {"skip": 1}}


def one_at_a_time(model: torch.nn.Module) -> None:
    """Let one thread at a time through ``model``'s forward itself, after the hooks that come
    before it (auto-attach's, the gate's): megatron's layers keep per-call state on the module
    (``TransformerLayer.mlp_norm_manager``), so two threads inside one decoder can fail there."""
    inside, held = threading.Lock(), threading.local()

    def enter(*_):
        inside.acquire()
        held.it = True

    def leave(*_):
        if getattr(held, "it", False):  # not where a hook before this one refused the call
            held.it = False
            inside.release()

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)


def test_first_forwards_in_many_threads_at_once_are_each_gated_or_refused_clearly(
    build, batch, count_mtp
):
    def first_forward(model, errors) -> None:
        try:
            forward_in(model, batch, "eval")
        except BaseException as exc:  # reported below
            errors.append(exc)

    switching = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        for _ in range(5):
            model = auto_attached(build)
            counter = count_mtp(model)
            one_at_a_time(model)
            mtp_hooks.configure("eval=run")  # threads that all run MTP share the model
            errors: list[BaseException] = []
            threads = [
                threading.Thread(target=first_forward, args=(model, errors)) for _ in range(4)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(THREAD_TIMEOUT)
            refused = [e for e in errors if "first forward began in two threads" in str(e)]
            assert errors == refused, [traceback.format_exception(e) for e in errors]
            gated = 4 - len(refused)
            assert counter.n == gated and mtp_hooks.attach(model).stats() == {
                "eval": {"run": gated}
            }
    finally:
        sys.setswitchinterval(switching)


class MeetInGet(weakref.WeakKeyDictionary):
    """The runtime's attached-models table, whose every ``get`` of ``model`` reads, then holds
    its thread until the other thread has read too: the interleaving of a race, on demand.
    Where a lock lets one thread in at a time, the first gives up waiting after half a second,
    and from then on no ``get`` waits."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.target = weakref.ref(model)
        self.barrier = threading.Barrier(2, timeout=0.5)

    def get(self, key, default=None):
        found = super().get(key, default)  # read first: both threads read before either writes
        if key is self.target() and not self.barrier.broken:
            try:
                self.barrier.wait()
            except threading.BrokenBarrierError:
                pass
        return found


def in_two_threads(work) -> list:
    """``work()`` in two threads at once; both results, or the first error raised."""
    results: list = [None, None]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = work()
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(THREAD_TIMEOUT)
    if errors:
        raise errors[0]
    return results


def gate_pre_hooks(model: torch.nn.Module) -> list:
    return [
        h
        for h in model._forward_pre_hooks.values()
        if type(getattr(h, "__self__", None)).__name__ == "MTPGate"
    ]


def test_two_threads_attaching_one_model_at_once_gate_it_once(build, batch, monkeypatch):
    model = build()
    monkeypatch.setattr(_runtime.process, "attached", MeetInGet(model))
    first, second = in_two_threads(lambda: mtp_hooks.attach(model))
    assert first is second and len(gate_pre_hooks(model)) == 1
    mtp_hooks.configure("eval=skip")
    forward_in(model, batch, "eval")
    assert first.stats() == {"eval": {"skip": 1}}


def test_two_threads_removing_one_handle_at_once_both_return(build, monkeypatch):
    model = build()
    handle = mtp_hooks.attach(model, role="teacher")
    table = MeetInGet(model)
    table[model] = handle
    monkeypatch.setattr(_runtime.process, "attached", table)
    in_two_threads(handle.remove)  # raised KeyError where both found the model still attached
    assert gate_pre_hooks(model) == [] and model not in table
    assert mtp_hooks.role_of(model) is None


def test_two_threads_that_both_skip_are_refused_without_saying_the_other_way(build, batch):
    model = build()
    mtp_hooks.attach(model)
    mtp_hooks.configure("eval=skip,rollout=skip")
    paused = Paused(model, batch, "eval")
    with pytest.raises(mtp_hooks.MTPHooksError) as refused:
        forward_in(model, batch, "rollout")
    paused.finish()
    assert "make MTP skip" in str(refused.value) and "even to the same decision" in str(
        refused.value
    )
    assert "other way" not in str(refused.value)

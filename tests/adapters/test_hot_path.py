"""What keeps the per-forward path cheap also keeps every guarantee.

The gate names the interpreter frame running a call once per call, in the pre-hook, through a
generator of the calling thread rather than ``sys._getframe`` (an audit event, which processes
that import ``transformers`` or megatron-core pay a Python audit hook for); it finds its record
in the forward hook by the kwargs dict torch hands both hooks of one call, and removes the
record of a call that changed nothing without its lock. Each shortcut has a fallback, tested
here.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import mtp_hooks

from model_fixtures import native

AUDITED_FORWARDS = textwrap.dedent(
    """
    import sys, threading, warnings
    warnings.simplefilter("ignore")
    import torch, mtp_hooks
    from mtp_hooks.demo import tiny_models

    tiny_models.init_single_process(port=tiny_models.free_port())
    tiny_models.reset_mtp_loss_tracker()
    torch.manual_seed(0)
    model = tiny_models.build_gpt(attention="sdpa")
    ids = torch.randint(0, 128, (2, 16))
    pos = torch.arange(16).unsqueeze(0).expand(2, -1)
    events = []
    sys.addaudithook(lambda event, args: event == "sys._getframe" and events.append(event))

    def count(policy):
        mtp_hooks.configure(policy)
        model(ids, pos, None, labels=ids)  # warm-up: first decisions, lazy imports
        events.clear()
        for _ in range(5):
            model(ids, pos, None, labels=ids)
        return len(events)

    def count_in_thread(policy):
        counted = []
        thread = threading.Thread(target=lambda: counted.append(count(policy)))
        thread.start()
        thread.join()
        return counted[0]

    bare = count(None)
    mtp_hooks.attach(model)
    print(bare, count("train=run"), count("train=skip"), count_in_thread("train=skip"))
    torch.distributed.destroy_process_group()
    """
)


def test_a_gated_forward_raises_no_frame_audit_event_after_its_threads_first_call():
    done = subprocess.run(
        [sys.executable, "-c", AUDITED_FORWARDS], capture_output=True, text=True, timeout=300
    )
    # judged by what it printed: gloo's threads have aborted the interpreter's exit (0.16)
    counts = done.stdout.split()[-4:]
    assert len(counts) == 4 and all(c.isdigit() for c in counts), done.stderr[-3000:]
    bare, run, skip, threaded = map(int, counts)
    assert run == skip == threaded == bare  # megatron's own lookups, none of the gate's


def test_a_later_pre_hook_that_replaces_kwargs_still_gets_the_gates_restored(build, batch):
    model = build()
    shared = model.config
    handle = mtp_hooks.attach(model)
    model.register_forward_pre_hook(lambda m, a, k: (a, dict(k)), with_kwargs=True)
    mtp_hooks.configure("train=skip")
    for _ in range(2):
        model(*batch.args(), labels=batch.labels)
    assert model.mtp_process is True and model.config is shared
    assert handle.gates[0].records == [] and handle.stats() == {"train": {"skip": 2}}


def test_a_native_flag_skip_leaves_the_callers_kwargs_alone(build, kind, batch):
    model = build(model_cls=native(kind))
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip")
    kwargs = {"labels": batch.labels}
    model(*batch.args(), **kwargs)
    assert kwargs == {"labels": batch.labels} and model.received[0][0] is False


def test_many_threads_running_mtp_together_leave_no_record_and_count_every_forward(
    build, batch, count_mtp
):
    model = build()
    counter = count_mtp(model)
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("eval=run")
    model.eval()
    # megatron's layers keep per-call state on the module (TransformerLayer.mlp_norm_manager),
    # so its decoder and MTP block each run one thread at a time here; the gate's hooks do not.
    for block in (model.decoder, model.mtp):
        busy = threading.Lock()
        block.register_forward_pre_hook(lambda m, a, busy=busy: busy.acquire() and None)
        block.register_forward_hook(lambda m, a, o, busy=busy: busy.release(), always_call=True)
    errors: list[BaseException] = []

    def work():
        try:
            with torch.no_grad():
                for _ in range(25):
                    model(*batch.args(), labels=batch.labels)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    finally:
        sys.setswitchinterval(switch)
    assert errors == []
    assert handle.gates[0].records == [] and handle.stats() == {"eval": {"run": 100}}
    assert counter.n == 100


def test_a_forward_that_raises_restores_through_the_kwargs_match(build, batch):
    model = build()
    shared = model.config
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip")

    def fail(module, args):
        raise RuntimeError("inside forward")

    hook = model.decoder.register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="inside forward"):
        model(*batch.args(), labels=batch.labels)
    hook.remove()
    assert model.mtp_process is True and model.config is shared
    assert handle.gates[0].records == []


def test_a_forward_started_while_its_threads_frame_generator_runs_names_its_frame_the_slow_way(
    build, batch
):
    from mtp_hooks.megatron import _call_stack

    model = build()
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip")
    model(*batch.args(), labels=batch.labels)  # this thread's generator exists now
    nested = []

    def tracer(frame, event, arg):  # runs inside the generator's resumption
        if frame.f_code is _call_stack._resumer.__code__ and not nested:
            nested.append(model(*batch.args(), labels=batch.labels))
        return None

    sys.settrace(tracer)
    try:
        model(*batch.args(), labels=batch.labels)
    finally:
        sys.settrace(None)
    assert len(nested) == 1
    assert handle.stats() == {"train": {"skip": 3}} and model.mtp_process is True
    assert handle.gates[0].records == []

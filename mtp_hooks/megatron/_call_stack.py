"""The call stack of a gated model: its forward calls that are running, or were interrupted.

Each call pushes one :data:`CallRecord` naming the interpreter frame that runs it (torch's own
hook-calling frame, alive exactly as long as the call). That makes three things decidable:

* **Interrupted calls.** torch runs ``always_call`` hooks for ``Exception`` only, so a
  ``KeyboardInterrupt`` or ``SystemExit`` leaves a record whose interpreter frame is gone from
  its thread's stack. :func:`prune` finds it and restores what the call changed.
* **Threads.** Records carry their thread. A call that would change the shared gates while
  another thread's forward of the same model is running is refused instead of swapping
  decisions (:func:`refuse_concurrent`).
* **Removal from inside a forward.** A record whose frame is still on a stack is a running
  call; removal waits for it.

Callers hold the gate's lock around the functions that take the record list, with one
exception: a call that changed nothing removes its own record in its forward hook without the
lock (one atomic ``list.remove``). So these functions read the list through snapshots, and a
record of such a call may vanish under them. The forward hook finds its record by the kwargs
dict it shares with the pre-hook, and by the frame when a later pre-hook replaced that dict.
:func:`copied` gives a deep-copied model's gate the records it starts with.

Frames are only ever read in the thread that runs them: the pre-hook names its caller through
a generator of its own thread (:func:`start_resumer`), and :func:`prune` walks the calling
thread's own stack. A stack another thread is running changes under the reader between two
bytecodes, and reading ``f_back`` through one crashed CPython 3.11 (``tests/stress``).
"""

from __future__ import annotations

import copy
import sys
import threading
from collections.abc import Generator
from types import FrameType
from typing import Any, Final

from .._errors import MTPHooksError

# What one call set on, or must put back on, a model: its two gates, and the MTP modules' own
# configs where a detached call changes them ((submodule, config) pairs, else None). Always
# three fields, built by gates() and read through the field numbers below: a plain tuple, as
# CallRecord is, because the pre-hook reads the base gates at every call, and indexing a
# tuple subclass (a named tuple) misses the interpreter's fast path for tuples.
Gates = tuple[Any, Any, tuple[tuple[Any, Any], ...] | None]
MTP_PROCESS: Final = 0
CONFIG: Final = 1
SUBS: Final = 2


def gates(mtp_process: Any, config: Any, subs: tuple[tuple[Any, Any], ...] | None = None) -> Gates:
    """The one place a :data:`Gates` record is built."""
    return (mtp_process, config, subs)


# One forward call of a gated model that is running, or that was interrupted: a plain tuple,
# built by call_record() and read through the field numbers below. One is built per forward,
# and a named tuple costs 400 ns more to build, which would put the run path over its goal of
# twice torch's own hook cost (docs/benchmarks.md).
CallRecord = tuple[int, FrameType | None, Gates | None, bool, Any]
THREAD: Final = 0  # the ident of the thread running the call (0: the record a copy starts with)
OWNER: Final = 1  # the interpreter frame running the call; None: the call is over already
RESTORE: Final = 2  # the Gates to put back when the call ends (put_back); None: nothing changed
SETTLE: Final = 3  # whether a skip owes Megatron DDP a settlement after forward
KWARGS: Final = 4  # the kwargs dict torch handed the call's hooks, which names it in the hooks


def call_record(
    thread: int, owner: FrameType | None, restore: Gates | None, settle: bool, kwargs: Any
) -> CallRecord:
    """The record of one call (the one place a :data:`CallRecord` is built)."""
    return (thread, owner, restore, settle, kwargs)


def copied(records: list[CallRecord], base: Gates, memo: dict[int, Any]) -> list[CallRecord]:
    """The records a deep copy of a model's gate starts with: none if no call was running, else
    one with no thread or frame that puts the original's ``base`` gates (and the MTP modules'
    configs a running call changed) back at the copy's first forward, in case the original
    was copied in the middle of a gated forward."""
    if not records:
        return []
    subs = base_subs(records)
    restore = (
        base if subs is None else gates(base[MTP_PROCESS], base[CONFIG], copy.deepcopy(subs, memo))
    )
    return [call_record(0, None, restore, False, None)]


_set = object.__setattr__


def prune(records: list[CallRecord], module: Any, finished: FrameType | None) -> bool:
    """Drop the records of calls that are over (``finished`` counts as over), newest first,
    putting back on ``module`` what each changed. Only interrupted calls leave such records.
    Returns whether one of them was the calling thread's.

    Only the calling thread's own stack is walked, so another thread's record counts as
    running while that thread lives. That thread repairs it at its next forward of the model
    (or its ``remove()``/``detach()``), and any thread does once that thread has ended.
    """
    me = threading.get_ident()
    mine = False
    snapshot = records[:]
    alive = _live_threads() if other_thread(snapshot, me) else ()
    here = sys._getframe()
    for record in reversed(snapshot):
        thread, owner, restore = record[THREAD], record[OWNER], record[RESTORE]
        if owner is not None and owner is not finished:
            if thread != me and thread in alive:
                continue
            if thread == me and _on_stack(owner, here):
                continue
        if not _discard(records, record):
            continue  # a call that changed nothing, which just ended and removed it itself
        mine = mine or thread == me
        if restore is not None:
            put_back(module, restore)
    return mine


def _live_threads() -> set[int]:
    """The idents of the threads running now (only the keys of ``sys._current_frames()`` are
    kept: its frames belong to running threads and are never walked)."""
    return set(sys._current_frames())


def put_back(module: Any, record: Gates) -> None:
    """Set ``module``'s two gates, ``mtp_process`` and ``config``, and each MTP module's
    ``config`` in the record's ``SUBS``."""
    _set(module, "mtp_process", record[MTP_PROCESS])
    _set(module, "config", record[CONFIG])
    subs = record[SUBS]
    if subs is not None:
        for submodule, config in subs:
            _set(submodule, "config", config)


def base_subs(records: list[CallRecord]) -> tuple[tuple[Any, Any], ...] | None:
    """The MTP modules' own configs, as the oldest recorded call that changed them found them
    (``None``: no recorded call changed them)."""
    for record in records[:]:
        restore = record[RESTORE]
        if restore is not None and restore[SUBS] is not None:
            subs: tuple[tuple[Any, Any], ...] = restore[SUBS]
            return subs
    return None


def _discard(records: list[CallRecord], record: CallRecord) -> bool:
    """Remove ``record`` (matched by identity: records of different calls differ in their
    thread or frame before any other field is compared); whether it was still there."""
    try:
        records.remove(record)
    except ValueError:
        return False
    return True


def pop_own(records: list[CallRecord], kwargs: Any, caller: FrameType) -> CallRecord | None:
    """Remove and return the record of the call whose forward hook got ``kwargs`` and is run by
    ``caller``, if there is one.

    torch hands the forward hook the very dict the call's pre-hooks ended with, a new one for
    every call, so ``kwargs`` names the call unless a pre-hook after the gate's replaced it;
    then the frame does, unless forward raised (torch's exception handler calls the hook).
    """
    snapshot = records[:]
    for key, field in ((kwargs, KWARGS), (caller, OWNER)):
        for record in reversed(snapshot):
            if record[field] is key and _discard(records, record):
                return record
    return None


def other_thread(records: list[CallRecord], thread: int) -> bool:
    """Whether a call of another thread than ``thread`` is recorded."""
    return any(record[THREAD] != thread for record in records[:])


def refuse_concurrent(records: list[CallRecord], module: Any, decision: str) -> None:
    """Raise :class:`MTPHooksError` for a call that would change gates another thread uses."""
    me = threading.get_ident()
    others = sorted({r[THREAD] for r in records[:] if r[THREAD] != me})
    raise MTPHooksError(
        f"mtp_hooks: {type(module).__name__} is running a forward in another thread "
        f"({', '.join(map(str, others))}) while this forward must change the model's MTP "
        f"gates to make MTP {decision}. The gates are attributes of the shared model, and a "
        "forward that changes them puts them back when it returns, so two threads cannot "
        "change them at once, even to the same decision. Forward one model per thread, or "
        "serialize the forwards of this model. (A forward that thread started and a "
        "KeyboardInterrupt ended counts as running until that thread forwards the model "
        "again or ends.)"
    )


def _on_stack(frame: FrameType, top: FrameType | None) -> bool:
    while top is not None:
        if top is frame:
            return True
        top = top.f_back
    return False


def _resumer() -> Generator[FrameType | None, Any, None]:
    """Each ``next()`` returns the caller of the function that called ``next()``: while a
    generator runs, its own frame's ``f_back`` is the frame that resumed it. Unlike
    ``sys._getframe``, this raises no audit event (in a process that imports ``filelock``, as
    megatron-core's imports do, every ``sys._getframe`` runs a Python audit hook)."""
    me = yield None
    while True:
        yield me.f_back.f_back


def start_resumer(local: threading.local) -> FrameType:
    """The pre-hook's caller, the slow way; also gives this thread its :func:`_resumer` in
    ``local.resumer`` (one per thread: a generator runs in one thread at a time). Called on a
    thread's first gated call, and for a call made while this thread's generator is running
    (from a signal handler or a trace function), which leaves that generator alone."""
    if not hasattr(local, "resumer"):
        resumer = _resumer()
        next(resumer)
        resumer.send(resumer.gi_frame)  # type: ignore[attr-defined]
        local.resumer = resumer
    return sys._getframe(2)

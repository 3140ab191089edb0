"""The record of one gated model's forward calls that are running, or that were interrupted.

Each call pushes one :data:`Frame` naming the interpreter frame that runs it (torch's own
hook-calling frame, alive exactly as long as the call). That makes three things decidable:

* **Interrupted calls.** torch runs ``always_call`` hooks for ``Exception`` only, so a
  ``KeyboardInterrupt`` or ``SystemExit`` leaves a record whose interpreter frame is gone from
  every thread's stack. :func:`prune` finds it and restores what the call changed.
* **Threads.** Records carry their thread. A call that would change the shared gates while
  another thread's forward of the same model is running is refused instead of swapping
  decisions (:func:`refuse_concurrent`).
* **Removal from inside a forward.** A record whose frame is still on a stack is a running
  call; removal waits for it.

Callers hold the gate's lock around every function here. :func:`config_copy` makes the config
a skipped or re-weighted call runs with; :func:`copy_gate` the gate of a deep-copied model.
"""

from __future__ import annotations

import copy
import sys
import threading
import weakref
from types import FrameType
from typing import Any, Final

from .._errors import MTPHooksError, UnsupportedModelError

# A plain tuple, the cheapest object to build per call: (thread ident, the interpreter frame that
# called the pre-hook or None for "always over", (mtp_process, config) to put back or None,
# whether MTP was skipped).
Frame = tuple[int, FrameType | None, tuple[Any, Any] | None, bool]
THREAD: Final = 0
OWNER: Final = 1
RESTORE: Final = 2
SKIPPED: Final = 3

_set = object.__setattr__


def prune(frames: list[Frame], module: Any, finished: FrameType | None) -> bool:
    """Drop the records of calls that are over (``finished`` counts as over), newest first,
    putting back on ``module`` what each changed. Only interrupted calls leave such records.
    Returns whether one of them was the calling thread's."""
    me = threading.get_ident()
    mine = False
    others = sys._current_frames() if other_thread(frames, me) else {}
    here = sys._getframe()
    for i in range(len(frames) - 1, -1, -1):
        thread, owner, restore, _ = frames[i]
        top = here if thread == me else others.get(thread)
        if owner is not None and owner is not finished and _on_stack(owner, top):
            continue
        del frames[i]
        mine = mine or thread == me
        if restore is not None:
            _set(module, "mtp_process", restore[0])
            _set(module, "config", restore[1])
    return mine


def pop_own(frames: list[Frame], caller: FrameType) -> Frame | None:
    """Remove and return the record of the call run by ``caller``, if there is one."""
    for i in range(len(frames) - 1, -1, -1):
        if frames[i][OWNER] is caller:
            return frames.pop(i)
    return None


def other_thread(frames: list[Frame], thread: int) -> bool:
    """Whether a call of another thread than ``thread`` is recorded."""
    return any(f[THREAD] != thread for f in frames)


def refuse_concurrent(frames: list[Frame], module: Any, decision: str) -> None:
    """Raise :class:`MTPHooksError` for a call that would change gates another thread uses."""
    others = sorted({f[0] for f in frames if f[0] != threading.get_ident()})
    raise MTPHooksError(
        f"mtp_hooks: {type(module).__name__} is running a forward in another thread "
        f"({', '.join(map(str, others))}) while this forward needs MTP to {decision} the "
        "other way. The MTP gates are attributes of the shared model, so two threads cannot "
        "hold different decisions at once. Forward one model per thread, or serialize the "
        "forwards of this model."
    )


def _on_stack(frame: FrameType, top: FrameType | None) -> bool:
    while top is not None:
        if top is frame:
            return True
        top = top.f_back
    return False


def config_copy(config: Any, **changes: Any) -> Any:
    """A fresh shallow copy of ``config`` with ``changes`` applied, e.g. ``mtp_num_layers=None``.

    Like ``copy.copy`` (no ``__init__``/``__post_init__``, so no re-validation), at half the cost
    for a plain dataclass; classes with ``__slots__`` or ``__copy__`` go through ``copy.copy``.
    """
    cls = type(config)
    state = getattr(config, "__dict__", None)
    if state is None or hasattr(cls, "__copy__"):
        new = copy.copy(config)
    else:
        new = object.__new__(cls)
        new.__dict__.update(state)
    for name, value in changes.items():
        setattr(new, name, value)
    return new


def copy_gate(gate: Any, memo: dict[int, Any]) -> Any:
    """The gate of a deep copy of ``gate``'s model, registered through ``gate.on_copy``.

    ``deepcopy`` reaches a gate through the hooks in its model's hook dicts, so the copied model
    is in ``memo`` (still being filled). The copy gets its own hooks (their handles copied in
    the same memo point at the copy's hook dicts), fresh counters, no DDP wrapper, and a record
    that restores the original's base gates at its first forward, in case the original was
    copied in the middle of a skipped forward.
    """
    from ._distributed import DDPState

    model = gate.model
    if model is None or id(model) not in memo:
        raise UnsupportedModelError(
            "mtp_hooks: copy the attached model itself, not its gate or AttachHandle"
        )
    new = object.__new__(type(gate))
    new.__dict__.update(gate.__dict__)
    new._model = weakref.ref(memo[id(model)])
    new.ddp = DDPState(memo[id(model)], [])
    new.base = copy.deepcopy(gate.base, memo)
    new.frames = [(0, None, new.base, False)] if gate.frames else []
    new.counts, new.cache, new.loss_scales, new.last_run, new.recorder = {}, {}, {}, None, None
    new.lock, new.removed = threading.Lock(), False
    memo[id(gate)] = new
    new.handles = copy.deepcopy(gate.handles, memo)
    if gate.on_copy is not None:
        gate.on_copy(new)
    return new

"""The per-model gate: a forward pre-hook that applies a decision and a forward hook that undoes it.

For one forward call of a ``GPTModel``/``HybridModel`` whose decision is *skip*, the gate either
passes the native ``compute_mtp_loss=False`` keyword, or turns off the two instance gates
Megatron reads: ``model.mtp_process`` and ``model.config.mtp_num_layers`` (through a view of the
config, :mod:`._config_view`, never by changing the shared object). The forward hook, registered
first and with ``always_call=True``, restores both before anything else, also when forward
raises.

What a call is to do comes from the gate's planner (:mod:`._call_planning`: the model's
execution mode, a plan per phase, the counters), before anything changes. The gate itself is
the apply/restore core: it keeps the model's own gates, DDP's state and the call stack
(:mod:`._call_stack`): every call pushes one record naming the interpreter frame that runs it,
so the gate can repair interrupted calls, tell threads apart and defer removal until running
calls return. What a call asks beyond its run or skip (a loss mask,
``+metrics``, ``+objective``) is a per-call extension (:mod:`._call_extensions`), begun once
the call is planned and ended once its gates are back. The gates are plain instance
attributes, written with ``object.__setattr__`` (``nn.Module``'s ends in the same).

Both hooks run at every forward, so they are written for speed (docs/benchmarks.md): globals
bound once, the plan cached per phase, one lock per call unless the call changes a gate, and
the record of a call that changes nothing built inline (each function call costs a few
percent of the run path's goal).

A compiled forward (``model.forward = torch.compile(model.forward)``) leaves both hooks to
torch's eager call around it, so nothing here meets dynamo. A compiled module
(``torch.compile(model)``) makes dynamo trace a module's hooks with its forward. The gate's
work (a lock, the thread's frames, the policy's sources) is Python that no graph can hold, so
each hook hands itself, first thing, to a ``torch.compiler.disable``d twin when dynamo is
tracing it: the decision runs eagerly, before and after the forward's graphs, and changes only
the instance attributes dynamo guards on. The check is one call per hook that returns False
(within noise on the CPU benchmark); a wrapper around the registered hooks would cost a
quarter of the run path's budget.
"""

from __future__ import annotations

import copy
import sys
import threading
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any, Final

import torch

from .. import _loss_masks, _runtime
from .._errors import UnsupportedModelError
from . import (
    _call_stack,
    _capabilities,
    _cuda_graphs,
    _ddp_settling,
    _refusals,
)
from ._call_extensions import Extensions
from ._call_planning import CallPlanner
from ._call_stack import CONFIG as _CONFIG
from ._call_stack import MTP_PROCESS as _MTP_PROCESS
from ._call_stack import Gates, call_record, gates
from ._config_view import Views
from ._config_view import config_view as _config_view
from ._loss_masking import LossMasks as _LossMasks
from ._phase_counters import DETACHED as _DETACHED
from ._phase_counters import RUN as _RUN
from ._phase_counters import SKIP as _SKIP
from ._phase_plan import PhasePlan

_get_ident = threading.get_ident
_getframe = sys._getframe
_set = object.__setattr__
# Each thread's frame reader: the runtime keeps this one object for the whole process.
_threads = _runtime.process.threads
_RESTORE: Final = _call_stack.RESTORE
_SETTLE: Final = _call_stack.SETTLE
_KWARGS: Final = _call_stack.KWARGS
# dynamo tracing this hook (the guard); is_compiling covers torch versions without the former
is_compiling = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)
_NO_MTP: Final = (("mtp_num_layers", None),)  # the config change of a skip
_REMOVED: Final = object()  # post_hook's output where torch calls it as a hook without kwargs
_open_blocks = _loss_masks.OPEN  # the context's masks are looked up only while blocks are open


class MTPGate:
    """Consults the policy at every forward of one language model and gates its MTP block."""

    def __init__(self, model: torch.nn.Module, ddp: _ddp_settling.DDPState, verify: bool):
        self._model = weakref.ref(model)
        self.plans = CallPlanner(model, verify)  # what each call is to do, and the counters
        self.ddp = ddp
        self.base = gates(model.mtp_process, model.config)
        self.records: list[_call_stack.CallRecord] = []
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        self.on_copy: Callable[[MTPGate], None] | None = None  # set by attach: adopt a deepcopy
        self._start_fresh()

    def _start_fresh(self) -> None:
        """The state a gate starts with, and a deep copy's gate starts over with."""
        self.loss_scales: dict[Any, float] = {}  # phase -> the last weight a forward used
        self.views = Views()  # the configs skipped and re-weighted calls run with
        self.lock = threading.Lock()
        self.extensions = Extensions(self.lock)  # each kind made by its first call
        self.ending = self.extensions.ending  # those with an end: the forward hook's one check
        self.removed = False

    def __deepcopy__(self, memo: dict[int, Any]) -> MTPGate:
        """The gate of a deep copy of the model, registered through ``on_copy``.

        ``deepcopy`` reaches a gate through the hooks in its model's hook dicts, so the copied
        model is in ``memo`` (still being filled). The copy gets its own hooks (their handles
        copied in the same memo point at the copy's hook dicts), fresh counters and plans, no
        DDP wrapper, and the call records of :func:`._call_stack.copied`.
        """
        model = self._model()
        if model is None or id(model) not in memo:
            raise UnsupportedModelError(
                "mtp_hooks: copy the attached model itself, not its gate or AttachHandle"
            )
        copied_model = memo[id(model)]
        new = object.__new__(MTPGate)
        new.__dict__.update(self.__dict__)
        new._start_fresh()
        new.plans = self.plans.copied()
        new._model = weakref.ref(copied_model)
        new.ddp = _ddp_settling.DDPState(copied_model, [])
        new.base = copy.deepcopy(self.base, memo)
        new.records = _call_stack.copied(self.records, new.base, memo)
        memo[id(self)] = new
        new.handles = copy.deepcopy(self.handles, memo)
        new.listen()
        if self.on_copy is not None:
            self.on_copy(new)
        return new

    @property
    def model(self) -> torch.nn.Module | None:
        """The gated model, or ``None`` once it has been garbage-collected."""
        return self._model()

    # -- hook registration -------------------------------------------------------------------
    def install(self) -> None:
        """Register the two hooks on the model, ahead of any other hook of the model."""
        model = self._model()
        assert model is not None
        self.handles = [
            model.register_forward_pre_hook(self.pre_hook, with_kwargs=True, prepend=True),
            model.register_forward_hook(
                self.post_hook, with_kwargs=True, always_call=True, prepend=True
            ),
        ]
        self.listen()

    # -- the hooks -----------------------------------------------------------------------------
    def pre_hook(
        self,
        module: torch.nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
        owner: FrameType | None = None,
    ) -> Any:
        """Decide for this call and apply it (a native-flag skip sets the flag in ``kwargs``).

        Three steps: put back what interrupted calls left (rare), plan without the lock
        (:meth:`._call_planning.CallPlanner.plan_call`) and begin the plan's extensions, apply
        under the lock. ``owner``: the interpreter frame running the call (found here when
        torch calls the hook; auto-attach passes its own).

        Raises:
            UnsupportedModelError: A skip that cannot be done safely; nothing is changed then.
            MTPHooksError: Another thread runs this model with gates this call must change.
        """
        if kwargs is None:  # removed after torch listed it for this call: leave the call alone
            return None
        if is_compiling():  # dynamo is tracing this call: decide outside its graphs
            return _pre_hook_eagerly(self, module, args, kwargs)
        if owner is None:  # torch's frame running this call, named by this thread's generator
            try:
                owner = next(_threads.resumer)
            except (AttributeError, ValueError):  # the thread's first call; one inside next()
                owner = _call_stack.start_resumer(_threads)
        records = self.records
        if records:  # a running call (nesting, another thread) or an interrupted one
            self._repair(module)
        # -- step 2, without the lock (a plugin may detach, or forward another model): this
        # call's plan, or None to leave MTP alone; then the extensions the plan lists --
        plan = self.plans.plan_call(module, args, kwargs, self.base if records else None)
        if plan is not None:
            extensions = plan.extensions
            if (
                _open_blocks[0]
                and plan.run
                and _LossMasks not in extensions
                and _loss_masks.context_masks()
            ):
                extensions = (_LossMasks, *extensions)  # an mtp_loss_mask block's mask
            if extensions:
                self.extensions.begin(extensions, module, plan, args, kwargs, self.base[_CONFIG])
        # -- step 3: apply, under the lock (acquire/release costs a third of a with-statement) --
        lock = self.lock
        lock.acquire()
        try:
            if self.removed:  # a plugin removed the gate while deciding: leave this call alone
                return
            thread = _get_ident()
            base = self.base
            mtp_process, config = module.mtp_process, module.config
            toggled = mtp_process is not base[_MTP_PROCESS] or config is not base[_CONFIG]
            current = gates(mtp_process, config) if toggled else base
            if toggled and not records:  # changed between calls: the new base
                self.base = base = current
                toggled = False
            if plan is None:  # leave MTP as it is
                records.append((thread, owner, None, False, kwargs))  # call_record(), inlined
            elif not plan.run:
                self._skip(module, owner, thread, plan.counters, current, kwargs)
            elif plan.changes is not None:  # a loss weight, +detach
                self._run_changed(module, owner, thread, plan, current, kwargs)
            else:
                if toggled and records and _call_stack.other_thread(records, thread):
                    _call_stack.refuse_concurrent(self.records, module, "run")
                plan.counters[_RUN] += 1
                if toggled:  # a running call changed the gates: this one runs on the base
                    self._apply(module, owner, thread, current, base, kwargs)
                else:
                    records.append((thread, owner, None, False, kwargs))  # call_record(), inlined
        finally:
            lock.release()

    def post_hook(
        self,
        module: torch.nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: Any = _REMOVED,
        caller: FrameType | None = None,
    ) -> Any:
        """Restore this call's gates first; then settle DDP state after a completed skip.
        ``caller``: the frame running the call, where torch did not call the hook itself.

        Called without ``kwargs`` (``output`` missing), it was removed after torch listed it
        for this call: the last call it restored has ended, and this one, which began after
        the pre-hook went, has nothing to restore."""
        if output is _REMOVED:
            return None
        if is_compiling():  # dynamo is tracing this call: restore outside its graphs
            return _post_hook_eagerly(self, module, args, kwargs, output)
        records = self.records
        try:
            top: _call_stack.CallRecord | None = records[-1]
        except IndexError:
            top = None
        if top is None or top[_KWARGS] is not kwargs:  # threads interleave, forward raised, or a
            caller = caller or _getframe(1)  # later hook replaced kwargs
            top = self._pop_and_restore(module, kwargs, caller)
        else:
            restore = top[_RESTORE]
            if restore is None:  # the call's own record, which changed nothing: list.remove is
                records.remove(top)  # atomic, and only this call removes it, so no lock is needed
            else:
                lock = self.lock
                lock.acquire()
                try:
                    records.remove(top)
                    _call_stack.put_back(module, restore)
                finally:
                    lock.release()
            if self.removed:
                self._finish_removal()
        if self.ending:
            replaced = self.extensions.end(module, output)
            if replaced is not None:  # an objective rides on the output into the backward
                return replaced
        if top is not None and top[_SETTLE] and output is not None:
            return self.ddp.after_skipped_forward(output)
        return None

    def _pop_and_restore(
        self, module: torch.nn.Module, kwargs: dict[str, Any], caller: FrameType
    ) -> _call_stack.CallRecord | None:
        """Take this call's record and those of interrupted calls; put back what they changed."""
        with self.lock:
            record = _call_stack.pop_own(self.records, kwargs, caller)
            _call_stack.prune(self.records, module, caller)
            restore = None if record is None else record[_RESTORE]
            if restore is not None:
                _call_stack.put_back(module, restore)
        if self.removed:
            self._finish_removal()
        return record

    def _run_changed(
        self,
        module: torch.nn.Module,
        owner: FrameType,
        thread: int,
        plan: PhasePlan,
        current: Gates,
        kwargs: dict[str, Any],
    ) -> None:
        """Run MTP with the decision's loss weight or detached (under the lock): megatron reads
        both from config fields at forward time, so this call sees config views carrying them.
        A detached call also hands the views to the MTP block and its layers, which read
        ``mtp_detach_heads`` from their own ``config``."""
        if self.records and _call_stack.other_thread(self.records, thread):
            _call_stack.refuse_concurrent(
                self.records, module, "run with its own loss weight or detach"
            )
        plan.counters[_RUN] += 1
        weight = plan.options.loss_scale
        if weight is not None:
            self.loss_scales[plan.phase] = weight
        base_config = self.base[_CONFIG]
        assert plan.changes is not None
        view = self.views.get(base_config, plan.changes)
        subs = None
        if plan.into_layers:
            plan.counters[_DETACHED] += 1
            subs = _call_stack.base_subs(self.records) or tuple(
                (sub, sub.config) for sub in _capabilities.detach_readers(module)
            )
            changes = plan.changes
            subs = tuple(
                (sub, view if config is base_config else _config_view(config, changes))
                for sub, config in subs
            )
        self._apply(
            module, owner, thread, current, gates(self.base[_MTP_PROCESS], view), kwargs, subs
        )

    def _apply(
        self,
        module: torch.nn.Module,
        owner: FrameType,
        thread: int,
        current: Gates,
        changed: Gates,
        kwargs: dict[str, Any],
        subs: tuple[tuple[Any, Any], ...] | None = None,
    ) -> None:
        """Record this call with what to put back, then set ``changed`` on the model, and
        ``subs`` on the MTP modules. Without ``subs``, MTP modules that a running (outer) call
        detached get their own configs back for this call."""
        if subs is None and self.records:
            subs = _call_stack.base_subs(self.records)
        if subs is not None:
            now = tuple((sub, sub.config) for sub, _ in subs)
            current = gates(current[_MTP_PROCESS], current[_CONFIG], now)
            changed = gates(changed[_MTP_PROCESS], changed[_CONFIG], subs)
        self.records.append(call_record(thread, owner, current, False, kwargs))
        _call_stack.put_back(module, changed)

    def _skip(
        self,
        module: torch.nn.Module,
        owner: FrameType,
        thread: int,
        counters: list[int],
        current: Gates,
        kwargs: dict[str, Any],
    ) -> None:
        """Apply a skip (under the lock): the native flag, or the two instance gates."""
        settle = self.ddp.check_skip()
        native = self.plans.native
        if not native and self.plans.tied_hazard:
            _refusals.refuse_tied_stage_skip()
        if self.records and _call_stack.other_thread(self.records, thread):
            _call_stack.refuse_concurrent(self.records, module, "skip")
        counters[_SKIP] += 1
        self.records.append(call_record(thread, owner, current, settle, kwargs))
        _set(module, "config", self.views.get(self.base[_CONFIG], _NO_MTP))
        if native:
            # The flag skips MTP and keeps mtp_process (the tied-embedding stage needs it); the
            # view tells everything that counts MTP heads (ModelOpt's loss) there are none.
            # torch builds a new kwargs dict for every call, so setting the flag in it reaches
            # this forward only, and keeps the dict the post-hook is handed.
            kwargs[_capabilities.NATIVE_FLAG] = False
        else:
            _set(module, "mtp_process", False)

    # -- hook removal ---------------------------------------------------------------------------
    def remove(self) -> None:
        """Remove both hooks and restore the gates.

        Called while a forward of the model runs (from a plugin, a submodule hook or another
        thread), it removes the pre-hook now and leaves the restoring hook until that forward
        returns, so no forward sees the gates flip half-way.
        """
        with self.lock:
            self.removed = True
            if self.handles:
                self.handles[0].remove()
            model = self._model()
            if model is not None:
                _call_stack.prune(self.records, model, None)
        self._finish_removal()

    def _repair(self, module: torch.nn.Module) -> None:
        """Step 1: put back what calls a ``KeyboardInterrupt`` ended left on the model."""
        with self.lock:
            interrupted = _call_stack.prune(self.records, module, None)
        if interrupted:
            self.extensions.cancel()  # a metrics request, an objective the call left open

    def _finish_removal(self) -> None:
        """Remove both hooks once no call of the model is running (called by removal, and by
        the forward hook of each call that ends after it)."""
        with self.lock:
            idle = not self.records
            if idle:
                for handle in self.handles:
                    handle.remove()
                self.handles = []
        if idle:  # what interrupted calls left: their metrics requests, their open objectives
            self.extensions.drop_all()
        _runtime.process.listeners.discard(self)

    # -- full-iteration CUDA graphs ------------------------------------------------------------
    def listen(self) -> None:
        """With full-iteration graphs, follow every change of what decisions depend on."""
        if self.plans.full_graphs:
            _runtime.process.listeners.add(self)

    def after_advance(self) -> None:
        """Something a decision depends on changed, and megatron's replays run no hook: have
        megatron capture its full-iteration graphs again (:func:`._cuda_graphs.recapture`)."""
        if not self.removed and self._model() is not None:
            _cuda_graphs.recapture()


# -- under torch.compile ---------------------------------------------------------------------


def traced_hooks_caller(name: str, file: str = __file__) -> FrameType | None:
    """The frame that called the hook ``name`` (a function of ``file``) while dynamo traced it:
    the frame running the model's call, alive until the call ends, as the frame torch calls a
    hook from is. ``None`` where it is not on this thread's stack (the hook then names its own
    caller)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == name and code.co_filename == file:
            return frame.f_back
        frame = frame.f_back
    return None


@torch.compiler.disable  # type: ignore[untyped-decorator]
def _pre_hook_eagerly(
    gate: MTPGate, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """:meth:`MTPGate.pre_hook`, run outside dynamo's graphs."""
    return gate.pre_hook(module, args, kwargs, traced_hooks_caller("pre_hook"))


@torch.compiler.disable  # type: ignore[untyped-decorator]
def _post_hook_eagerly(
    gate: MTPGate,
    module: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    output: Any,
) -> Any:
    """:meth:`MTPGate.post_hook`, run outside dynamo's graphs."""
    return gate.post_hook(module, args, kwargs, output, traced_hooks_caller("post_hook"))

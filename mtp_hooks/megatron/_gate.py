"""The per-model gate: a forward pre-hook that applies a decision and a forward hook that undoes it.

For one forward call of a ``GPTModel``/``HybridModel`` whose decision is *skip*, the gate either
passes the native ``compute_mtp_loss=False`` keyword, or turns off the two instance gates
Megatron reads: ``model.mtp_process`` and ``model.config.mtp_num_layers`` (through a view of the
config, :mod:`._config_view`, never by changing the shared object). The forward hook, registered
first and with ``always_call=True``, restores both before anything else, also when forward
raises.

Every call pushes one record (:mod:`._calls`) naming the interpreter frame that runs it, so
the gate can repair interrupted calls, tell threads apart and defer removal until running calls
return. ``+metrics`` also asks :mod:`._recorder` to measure the call's MTP. The gates are plain
instance attributes, written with ``object.__setattr__`` (``nn.Module``'s ends in the same).

Both hooks run at every forward, so they are written for speed (docs/benchmarks.md): globals
bound once, the decision cached per phase, one lock per call unless the call changes a gate.
"""

from __future__ import annotations

import sys
import threading
from types import FrameType
from typing import Any, Final

import torch

from .. import _loss_masks, _phases, _runtime, _sources
from . import _calls, _capabilities, _loss_masking, _recorder, _refusals
from ._config_view import config_view as _config_view
from ._gate_state import Entry, GateState

_RUN, _SKIP, _UNTOUCHED, _DETACHED = range(4)  # slots of a phase's counters (_handle.COUNTED)
_get_ident = threading.get_ident
_threads = threading.local()  # each thread's frame-naming generator (_calls.start_resumer)
_getframe = sys._getframe
_set = object.__setattr__
_RESTORE: Final = _calls.RESTORE
_SETTLE: Final = _calls.SETTLE
_KWARGS: Final = _calls.KWARGS
# dynamo tracing this hook (the guard); is_compiling covers torch versions without the former
_is_compiling = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)
_grad_enabled = torch.is_grad_enabled
_explicit_phase = _phases.explicit_phase.get  # the innermost phase() block, or None
_TRAIN, _EVAL = _phases.Phase.TRAIN, _phases.Phase.EVAL
_NO_MTP: Final = (("mtp_num_layers", None),)  # the config change of a skip
_open_blocks = _loss_masks.OPEN  # the context's masks are looked up only while blocks are open


class MTPGate(GateState):
    """Consults the policy at every forward of one language model and gates its MTP block."""

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
        kwargs: dict[str, Any],
        owner: FrameType | None = None,
    ) -> Any:
        """Decide for this call and apply it (a native-flag skip sets the flag in ``kwargs``).

        Three steps: put back what interrupted calls left (rare), decide without the lock
        (:meth:`_decide_call`), apply under it (below). ``owner``: the interpreter frame running
        the call (found here when torch calls the hook; auto-attach passes its own).

        Raises:
            UnsupportedModelError: A skip that cannot be done safely; nothing is changed then.
            MTPHooksError: Another thread runs this model with gates this call must change.
        """
        if owner is None:  # torch's frame running this call, named by this thread's generator
            try:
                owner = next(_threads.resumer)
            except (AttributeError, ValueError):  # the thread's first call; one inside next()
                owner = _calls.start_resumer(_threads)
        records = self.records
        if records:  # a running call (nesting, another thread) or an interrupted one
            self._repair(module)
        entry = self._decide_call(module, args, kwargs, records)
        # -- step 3: apply, under the lock (acquire/release costs a third of a with-statement) --
        lock = self.lock
        lock.acquire()
        try:
            if self.removed:  # a plugin removed the gate while deciding: leave this call alone
                return
            thread = _get_ident()
            base = self.base
            mtp_process, config = module.mtp_process, module.config
            toggled = mtp_process is not base[0] or config is not base[1]
            current = (mtp_process, config) if toggled else base
            if toggled and not records:  # changed between calls: the new base
                self.base = base = current
                toggled = False
            if entry is None:  # leave MTP as it is
                records.append((thread, owner, None, False, kwargs))
            elif not entry.run:
                self._skip(module, owner, thread, entry.counters, current, kwargs)
            elif entry.changes is not None:  # a loss weight, +detach
                self._run_changed(module, owner, thread, entry, current, kwargs)
            else:
                if toggled and records and _calls.other_thread(records, thread):
                    _calls.refuse_concurrent(self.records, module, "run")
                entry.counters[_RUN] += 1
                if toggled:  # a running call changed the gates: this one runs on the base
                    self._apply(module, owner, thread, current, base, kwargs)
                else:
                    records.append((thread, owner, None, False, kwargs))
        finally:
            lock.release()

    def _decide_call(
        self,
        module: torch.nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        records: list[_calls.CallRecord],
    ) -> Entry | None:
        """Step 2, without the lock (a plugin may detach, or forward another model): the
        decision of this call's phase, or ``None`` to leave MTP alone (inference, MTP off)."""
        active = self.inference_active
        inference = active is not None and active()
        if kwargs and not inference:
            for name in self.inference_names:
                if name in kwargs and kwargs[name] is not None:
                    inference = True
        if len(args) > self.inference_from:
            for index in self.inference_positions:
                if index < len(args) and args[index] is not None:
                    inference = True
        if inference:
            self._counters("inference")[_UNTOUCHED] += 1
            return None
        if _is_compiling():
            _refusals.refuse_compiling()
        if records:  # the gates a running call set are not this call's
            mtp_process, config = self.base
        else:
            mtp_process, config = module.mtp_process, module.config
        if not (mtp_process and config.mtp_num_layers):  # MTP is off, or on another stage
            if not self.loss_stage:
                return None
            entry = self._follow_mtp_stage(module, args, kwargs)  # never +metrics (refused)
        else:
            phase = _explicit_phase()
            if phase is None:
                phase = _TRAIN if module.training and _grad_enabled() else _EVAL
            cached = self.cache.get(phase)
            runtime = _runtime.current  # while watching, generation() reads the sources
            generation = _sources.generation() if runtime.watching else runtime.generation
            if cached is None or cached.generation != generation or self.checks:
                entry = self._decide(module, phase)
            else:
                entry = cached
        if entry.masking or (_open_blocks[0] and entry.run and _loss_masks.context_masks()):
            _loss_masking.apply(self, module, entry, args, kwargs)  # before +metrics reads it
        if entry.metrics:  # +metrics: ask model.mtp's output to be measured
            self.recorder = self.recorder or _recorder.Recorder(module)
            self.recorder.request(module, entry.phase, args, kwargs)
        return entry

    def post_hook(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        """Restore this call's gates first; then settle DDP state after a completed skip."""
        records = self.records
        try:
            top: _calls.CallRecord | None = records[-1]
        except IndexError:
            top = None
        if top is None or top[_KWARGS] is not kwargs:  # threads interleave, forward raised, or a
            top = self._pop_and_restore(module, kwargs, _getframe(1))  # later hook replaced kwargs
        else:
            restore = top[_RESTORE]
            if restore is None:  # the call's own record, which changed nothing: list.remove is
                records.remove(top)  # atomic, and only this call removes it, so no lock is needed
            else:
                lock = self.lock
                lock.acquire()
                try:
                    records.remove(top)
                    _calls.put_back(module, restore)
                finally:
                    lock.release()
            if self.removed:
                self._finish_removal()
        if self.recorder is not None:
            self.recorder.end(module, completed=output is not None)
        if top is not None and top[_SETTLE] and output is not None:
            return self.ddp.after_skipped_forward(output)
        return None

    def _pop_and_restore(
        self, module: torch.nn.Module, kwargs: dict[str, Any], caller: FrameType
    ) -> _calls.CallRecord | None:
        """Take this call's record and those of interrupted calls; put back what they changed."""
        with self.lock:
            record = _calls.pop_own(self.records, kwargs, caller)
            _calls.prune(self.records, module, caller)
            restore = None if record is None else record[_RESTORE]
            if restore is not None:
                _calls.put_back(module, restore)
        if self.removed:
            self._finish_removal()
        return record

    def _run_changed(
        self,
        module: torch.nn.Module,
        owner: FrameType,
        thread: int,
        cached: Entry,
        current: tuple[Any, Any],
        kwargs: dict[str, Any],
    ) -> None:
        """Run MTP with the decision's loss weight or detached (under the lock): megatron reads
        both from config fields at forward time, so this call sees config views carrying them.
        A detached call also hands the views to the MTP block and its layers, which read
        ``mtp_detach_heads`` from their own ``config``."""
        if self.records and _calls.other_thread(self.records, thread):
            _calls.refuse_concurrent(self.records, module, "run with its own loss weight or detach")
        cached.counters[_RUN] += 1
        if cached.loss_scale is not None:
            self.loss_scales[cached.phase] = cached.loss_scale
        base_mtp_process, base_config = self.base
        assert cached.changes is not None
        view = self.views.get(base_config, cached.changes)
        subs = None
        if cached.detach:
            cached.counters[_DETACHED] += 1
            subs = _calls.base_subs(self.records) or tuple(
                (sub, sub.config) for sub in _capabilities.detach_readers(module)
            )
            changes = cached.changes
            subs = tuple(
                (sub, view if config is base_config else _config_view(config, changes))
                for sub, config in subs
            )
        self._apply(module, owner, thread, current, (base_mtp_process, view), kwargs, subs)

    def _apply(
        self,
        module: torch.nn.Module,
        owner: FrameType,
        thread: int,
        current: tuple[Any, ...],
        gates: tuple[Any, ...],
        kwargs: dict[str, Any],
        subs: tuple[tuple[Any, Any], ...] | None = None,
    ) -> None:
        """Record this call with what to put back, then set ``gates`` on the model, and
        ``subs`` on the MTP modules. Without ``subs``, MTP modules that a running (outer) call
        detached get their own configs back for this call."""
        if subs is None and self.records:
            subs = _calls.base_subs(self.records)
        if subs is not None:
            now = tuple((sub, sub.config) for sub, _ in subs)
            current, gates = (*current, now), (*gates, subs)
        self.records.append((thread, owner, current, False, kwargs))
        _calls.put_back(module, gates)

    def _skip(
        self,
        module: torch.nn.Module,
        owner: FrameType,
        thread: int,
        counters: list[int],
        current: tuple[Any, Any],
        kwargs: dict[str, Any],
    ) -> None:
        """Apply a skip (under the lock): the native flag, or the two instance gates."""
        settle = self.ddp.check_skip()
        if not self.native and self.tied_hazard:
            _refusals.refuse_tied_stage_skip()
        if self.records and _calls.other_thread(self.records, thread):
            _calls.refuse_concurrent(self.records, module, "skip")
        counters[_SKIP] += 1
        self.records.append((thread, owner, current, settle, kwargs))
        _set(module, "config", self.views.get(self.base[1], _NO_MTP))
        if self.native:
            # The flag skips MTP and keeps mtp_process (the tied-embedding stage needs it); the
            # view tells everything that counts MTP heads (ModelOpt's loss) there are none.
            # torch builds a new kwargs dict for every call, so setting the flag in it reaches
            # this forward only, and keeps the dict the post-hook is handed.
            kwargs[_capabilities.NATIVE_FLAG] = False
        else:
            _set(module, "mtp_process", False)

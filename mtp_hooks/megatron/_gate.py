"""The per-model gate: a forward pre-hook that applies a decision and a forward hook that undoes it.

For one forward call of a ``GPTModel``/``HybridModel`` whose decision is *skip*, the gate either
passes the native ``compute_mtp_loss=False`` keyword, or turns off the two instance gates
Megatron reads: ``model.mtp_process`` and ``model.config.mtp_num_layers`` (through a shallow copy
of the config, never the shared object). The forward hook, registered first and with
``always_call=True``, restores both before anything else, also when forward raises.

Every call pushes one record (:mod:`._calls`) naming the interpreter frame that runs it, which
lets the gate repair interrupted calls, tell threads apart and defer removal until running
calls return. A ``+metrics`` decision also asks :mod:`._recorder` to measure the call's MTP.
The gates are plain instance attributes (never parameters, buffers or submodules), written with
``object.__setattr__``, where ``nn.Module.__setattr__`` ends after its isinstance checks.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any, Final, cast

import torch

from .. import _decision, _phases, _roles, _sources
from . import _calls, _capabilities, _distributed, _recorder, _refusals

_RUN, _SKIP, _UNTOUCHED = range(3)  # slots of a phase's counters
# A cached decision: (generation, run, the phase's counters, loss weight or None, metrics)
_Entry = tuple[int, bool, list[int], float | None, bool]
_get_ident = threading.get_ident
_getframe = sys._getframe
_OWNER: Final = _calls.OWNER
_RESTORE: Final = _calls.RESTORE
_SKIPPED: Final = _calls.SKIPPED
# dynamo tracing this hook (the guard); is_compiling covers torch versions without the former
_is_compiling = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)
_grad_enabled = torch.is_grad_enabled
_current_phase = _phases._current.get  # the innermost phase() block, or None
_TRAIN, _EVAL = _phases.Phase.TRAIN, _phases.Phase.EVAL


class MTPGate:
    """Consults the policy at every forward of one language model and gates its MTP block."""

    def __init__(self, model: torch.nn.Module, ddp: _distributed.DDPState, verify: bool):
        self._model = weakref.ref(model)
        self.cls: Any = cast(Any, type(model))  # hashable for the capability caches
        self.native = _capabilities.native_flag(self.cls)
        self.inference_names, self.inference_positions = _capabilities.inference_arguments(self.cls)
        self.inference_mode = _capabilities.inference_mode_class()
        self.tied_hazard = not self.native and _capabilities.tied_mtp_stage(model)
        self.verify = verify
        self.ddp = ddp
        self.base: tuple[Any, Any] = (model.mtp_process, model.config)
        self.cuda_graphs = _capabilities.uses_cuda_graphs(model.config)
        self.checks = verify or self.cuda_graphs  # a per-call check: decide at every call
        _refusals.refuse_unsupported_config(model.config)
        self.frames: list[_calls.Frame] = []
        self.counts: dict[Any, list[int]] = {}  # phase -> [runs, skips, untouched]
        self.cache: dict[Any, _Entry] = {}  # phase -> _decide's entry
        self.loss_scales: dict[Any, float] = {}  # phase -> the last weight a forward used
        self.last_run: bool | None = None
        self.recorder: _recorder.Recorder | None = None  # made by the first +metrics decision
        self.lock = threading.Lock()
        self.removed = False
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        self.on_copy: Callable[[MTPGate], None] | None = None  # set by attach: adopt a deepcopy

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
                _calls.prune(self.frames, model, None)
            if not self.frames:
                for handle in self.handles[1:]:
                    handle.remove()
                self.handles = []

    # -- the hooks -----------------------------------------------------------------------------
    def pre_hook(
        self,
        module: torch.nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        owner: FrameType | None = None,
    ) -> Any:
        """Decide for this call and apply it; returns new ``(args, kwargs)`` only for the flag.

        ``owner`` is the interpreter frame running the call (torch's, found here when torch
        calls the hook; auto-attach passes it when it calls the hook itself).

        Raises:
            UnsupportedModelError: A skip that cannot be done safely; nothing is changed then.
            MTPHooksError: Another thread runs this model with gates this call must change.
        """
        cached: _Entry  # set where a decision is made (run is not None)
        if owner is None:
            owner = _getframe(1)
        frames = self.frames
        if frames:  # a running call (nesting, another thread) or an interrupted one
            with self.lock:
                interrupted = _calls.prune(self.frames, module, None)
            if interrupted and self.recorder is not None:
                self.recorder.cancel()  # the metrics request the interrupted call left
        # -- decide (no lock held: a plugin may detach, or forward another model) --
        mode = self.inference_mode
        inference = mode is not None and mode.is_active()
        if kwargs and not inference:
            for name in self.inference_names:
                if kwargs.get(name) is not None:
                    inference = True
        for index in self.inference_positions:
            if index < len(args) and args[index] is not None:
                inference = True
        if inference:
            self._counters("inference")[_UNTOUCHED] += 1
            run: bool | None = None
        elif _is_compiling():
            _refusals.refuse_compiling()
        else:
            mtp_process, config = self.base if frames else (module.mtp_process, module.config)
            if mtp_process and getattr(config, "mtp_num_layers", None):
                phase = _current_phase()
                if phase is None:
                    phase = _TRAIN if module.training and _grad_enabled() else _EVAL
                found = self.cache.get(phase)
                if found is None or found[0] != _sources.generation() or self.checks:
                    found = self._decide(module, phase)
                cached = found
                run = cached[1]
                if cached[4]:  # +metrics: ask model.mtp's output to be measured
                    self.recorder = self.recorder or _recorder.Recorder(module)
                    self.recorder.request(module, phase, args, kwargs)
            else:
                run = None  # MTP already off (by someone else): nothing to decide
        # -- apply --
        with self.lock:
            if self.removed:  # a plugin removed the gate while deciding: leave this call alone
                return None
            thread = _get_ident()
            current = (module.mtp_process, module.config)
            if not frames:
                self.base = current
            if run is None:
                frames.append((thread, owner, None, False))
                return None
            base = self.base
            toggled = current[0] is not base[0] or current[1] is not base[1]
            if not run:
                return self._skip(module, owner, thread, cached[2], current, args, kwargs)
            if cached[3] is not None:
                return self._run_weighted(module, owner, thread, phase, cached, current)
            if toggled and frames and _calls.other_thread(frames, thread):
                _calls.refuse_concurrent(self.frames, module, "run")
            cached[2][_RUN] += 1
            if not toggled:
                frames.append((thread, owner, None, False))
                return None
            frames.append((thread, owner, current, False))
            _set(module, "mtp_process", base[0])
            _set(module, "config", base[1])
            return None

    def post_hook(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        """Restore this call's gates first; then settle DDP state after a completed skip."""
        caller = _getframe(1)
        with self.lock:
            frames = self.frames
            if frames and frames[-1][_OWNER] is caller:
                frame: _calls.Frame | None = frames.pop()
            else:  # forward raised (caller is torch's exception handler) or threads interleave
                frame = _calls.pop_own(self.frames, caller)
                _calls.prune(self.frames, module, caller)
            restore = None if frame is None else frame[_RESTORE]
            if restore is not None:
                _set(module, "mtp_process", restore[0])
                _set(module, "config", restore[1])
            if self.removed and not frames:
                for handle in self.handles:
                    handle.remove()
                self.handles = []
        if self.recorder is not None:
            self.recorder.end(module, completed=output is not None)
        if frame is not None and frame[_SKIPPED] and output is not None:
            return self.ddp.after_skipped_forward(output)
        return None

    # -- deciding ------------------------------------------------------------------------------
    def _decide(self, module: torch.nn.Module, phase: Any) -> _Entry:
        """Decide for ``phase``; returns ``(generation, run, the phase's counters, loss
        weight)``, cached while nothing a decision depends on changes and no per-call check
        is on."""
        generation = _sources.generation()
        decision, cacheable = _decision.decide_normalized(module, phase, _roles.role_of(module))
        if self.verify:
            _distributed.verify_agreement(decision, phase)
        if self.cuda_graphs:
            _refusals.check_cuda_graph_decision(self.last_run, decision.run, self.base[1])
            self.last_run = decision.run
        counters = self._counters(phase)
        entry = (generation, decision.run, counters, decision.loss_scale, decision.metrics)
        if cacheable:
            self.cache[phase] = entry
        return entry

    def _run_weighted(
        self,
        module: torch.nn.Module,
        owner: FrameType,
        thread: int,
        phase: Any,
        cached: _Entry,
        current: tuple[Any, Any],
    ) -> None:
        """Run MTP with the decision's loss weight (under the lock): the model reads the weight
        from its own config at forward time, so this call gets a config copy carrying it."""
        if self.frames and _calls.other_thread(self.frames, thread):
            _calls.refuse_concurrent(self.frames, module, "run with its own loss weight")
        cached[2][_RUN] += 1
        assert cached[3] is not None
        self.loss_scales[phase] = cached[3]
        self.frames.append((thread, owner, current, False))
        base_mtp_process, base_config = self.base
        _set(module, "mtp_process", base_mtp_process)
        _set(module, "config", _calls.config_copy(base_config, mtp_loss_scaling_factor=cached[3]))

    def _skip(
        self,
        module: torch.nn.Module,
        owner: FrameType,
        thread: int,
        counters: list[int],
        current: tuple[Any, Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Apply a skip (under the lock): the native flag, or the two instance gates."""
        self.ddp.check_skip_allowed()
        if not self.native and self.tied_hazard:
            _refusals.refuse_tied_stage_skip()
        if self.frames and _calls.other_thread(self.frames, thread):
            _calls.refuse_concurrent(self.frames, module, "skip")
        counters[_SKIP] += 1
        self.frames.append((thread, owner, current, True))
        _set(module, "config", _calls.config_copy(self.base[1], mtp_num_layers=None))
        if self.native:
            # The flag skips MTP and keeps mtp_process (the tied-embedding stage needs it); the
            # config copy tells everything that counts MTP heads (ModelOpt's loss) there are none.
            return args, {**kwargs, _capabilities.NATIVE_FLAG: False}
        _set(module, "mtp_process", False)
        return None

    # -- helpers -------------------------------------------------------------------------------
    def _counters(self, phase: Any) -> list[int]:
        counters = self.counts.get(phase)
        if counters is None:
            counters = self.counts[phase] = [0, 0, 0]
        return counters

    def __deepcopy__(self, memo: dict[int, Any]) -> MTPGate:
        """A gate of its own for a deep copy of the model (:func:`._calls.copy_gate`)."""
        copied: MTPGate = _calls.copy_gate(self, memo)
        return copied


_set = object.__setattr__

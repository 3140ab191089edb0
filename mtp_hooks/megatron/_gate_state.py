"""What a gate knows and keeps about its model, and how its two hooks come and go.

:class:`GateState` holds the facts fixed at attach time (the native flag, where inference
contexts are passed, the tied-embedding hazard, CUDA graphs), the record of running calls
(:mod:`._calls`), the per-phase decision cache and counters, and the hook handles.
:class:`._gate.MTPGate` adds the two hooks that run at every forward.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, cast

import torch

from .. import _decision, _phases, _roles, _runtime, _sources
from ..plugins import _registry
from . import _calls, _capabilities, _cuda_graphs, _distributed, _recorder, _refusals, _standalone
from ._config_view import Changes, Views


@dataclasses.dataclass(slots=True)
class Entry:
    """A phase's cached decision, as the hooks read it. Never changed once made (entries are
    shared by every call of the phase); slots, not a frozen class or a named tuple, because
    the hooks read five fields per call and a frozen class costs five times as much to build,
    once per forward for plugins asked at every forward (docs/benchmarks.md)."""

    phase: Any
    """The phase it decides."""
    generation: int
    """The runtime generation it was made at (:mod:`mtp_hooks._runtime`)."""
    run: bool
    counters: list[int]
    """The phase's ``[runs, skips, untouched]``, counted in place."""
    loss_scale: float | None
    """The MTP loss weight for this phase, or ``None``: the model's own."""
    metrics: bool
    """Whether the call records MTP loss and acceptance (``+metrics``)."""
    detach: bool
    """Whether MTP trains on detached inputs (``+detach``)."""
    changes: Changes | None
    """The config fields a call that runs MTP changes (weight, detach), or ``None``."""
    masks: bool
    """Whether plugins' ``mtp_loss_mask`` answers are asked for at calls that run MTP."""
    ignore_index: int | None
    """The label a ``+mask:labels`` call leaves out of the MTP loss, or ``None``."""
    masking: bool
    """``masks`` or an ``ignore_index``: the call gets a mask of its own (read per call)."""


class GateState:
    """The state of one model's gate; the hooks are :class:`._gate.MTPGate`'s."""

    def __init__(self, model: torch.nn.Module, ddp: _distributed.DDPState, verify: bool):
        self._model = weakref.ref(model)
        self.cls: Any = cast(Any, type(model))  # hashable for the capability caches
        self.native = _capabilities.native_flag(self.cls)
        self.inference_names, self.inference_positions = _capabilities.inference_arguments(self.cls)
        self.inference_from = min(self.inference_positions, default=sys.maxsize)
        mode = _capabilities.inference_mode_class()
        self.inference_active = None if mode is None else mode.is_active
        self.tied_hazard = not self.native and _capabilities.tied_mtp_stage(model)
        self.verify = verify
        self.ddp = ddp
        self.base: tuple[Any, Any] = (model.mtp_process, model.config)
        graphs = _cuda_graphs.implementation(model.config)
        self.loss_stage = _capabilities.standalone_loss_stage(model)  # follows the MTP stage
        self.standalone = bool(getattr(model.config, "mtp_standalone", False))
        self.labels_at = _capabilities.labels_position(self.cls)
        self.local_graphs = (
            graphs == "local" and not self.loss_stage and _cuda_graphs.mtp_layers_graphed(model)
        )
        self.full_graphs = graphs == "full_iteration"
        if self.full_graphs:
            _cuda_graphs.refuse_unfollowable_full_graphs()
        self.ep_overlap = bool(getattr(model.config, "overlap_moe_expert_parallel_comm", False))
        self.detach_refusal = _refusals.detach_refusal(model.config, graphs)
        self.checks = verify or self.local_graphs  # a per-call check: decide at every call
        self.policy_checked = -1  # the generation whose policy was checked against the above
        self.records: list[_calls.CallRecord] = []
        self.counts: dict[Any, list[int]] = {}  # [runs, skips, untouched, detached, masked]
        self.cache: dict[Any, Entry] = {}  # phase -> _decide's entry
        self.loss_scales: dict[Any, float] = {}  # phase -> the last weight a forward used
        self.recorder: _recorder.Recorder | None = None  # made by the first +metrics decision
        self.views = Views()  # the configs skipped and re-weighted calls run with
        self.lock = threading.Lock()
        self.removed = False
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        self.on_copy: Callable[[Any], None] | None = None  # set by attach: adopt a deepcopy

    @property
    def model(self) -> torch.nn.Module | None:
        """The gated model, or ``None`` once it has been garbage-collected."""
        return self._model()

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
                _calls.prune(self.records, model, None)
        self._finish_removal()

    def _repair(self, module: torch.nn.Module) -> None:
        """Step 1: put back what calls a ``KeyboardInterrupt`` ended left on the model."""
        with self.lock:
            interrupted = _calls.prune(self.records, module, None)
        if interrupted and self.recorder is not None:
            self.recorder.cancel()  # the metrics request the interrupted call left

    def _finish_removal(self) -> None:
        """Remove both hooks once no call of the model is running (called by removal, and by
        the forward hook of each call that ends after it)."""
        with self.lock:
            if not self.records:
                for handle in self.handles:
                    handle.remove()
                self.handles = []
        _runtime.current.listeners.discard(self)

    # -- full-iteration CUDA graphs ------------------------------------------------------------
    def listen(self) -> None:
        """With full-iteration graphs, follow every change of what decisions depend on."""
        if self.full_graphs:
            _runtime.current.listeners.add(self)

    def after_advance(self) -> None:
        """Something a decision depends on changed, and megatron's replays run no hook: have
        megatron capture its full-iteration graphs again (:func:`._cuda_graphs.recapture`)."""
        if not self.removed and self._model() is not None:
            _cuda_graphs.recapture()

    # -- deciding ------------------------------------------------------------------------------
    def _decide(self, module: torch.nn.Module, phase: Any) -> Entry:
        """Decide for ``phase``; the entry is cached while nothing a decision depends on
        changes and no per-call check is on."""
        generation = _sources.generation()
        role = _roles.role_of(module)
        if self.policy_checked != generation:
            self.check_policy(module, role)
            self.policy_checked = generation
        decision, cacheable = _decision.decide_normalized(module, phase, role)
        if self.verify and not (self.full_graphs and _cuda_graphs.capturing()):
            _distributed.verify_agreement(decision, phase)  # host syncs: never inside a capture
        if self.local_graphs and decision.run:
            _cuda_graphs.check_replayable(module)
        changes: list[tuple[str, Any]] = []
        if decision.run and decision.loss_scale is not None:
            changes.append(("mtp_loss_scaling_factor", decision.loss_scale))
        if decision.run and decision.detach:
            refusal = self.detach_refusal or _refusals.clipping_refusal(module)
            if refusal is not None:
                by = decision.detach_by
                by = "the policy config" if by == "config" else f"plugin {by}"
                _refusals.refuse_detach(str(phase), by, refusal)
            changes.append(("mtp_detach_heads", True))
        counters = self._counters(phase)
        masks = decision.run and decision.plugin_masks and _registry().implements("mtp_loss_mask")
        ignore = decision.ignore_index if decision.run and decision.mask == "labels" else None
        entry = Entry(
            phase,
            generation,
            decision.run,
            counters,
            decision.loss_scale,
            decision.metrics,
            decision.run and decision.detach,
            tuple(changes) or None,
            masks,
            ignore,
            masks or ignore is not None,
        )
        if cacheable:
            self.cache[phase] = entry
        return entry

    def check_policy(self, module: torch.nn.Module, role: str | None) -> None:
        """Refuse a policy this model's execution mode cannot follow: CUDA graphs, the combined
        1F1B schedule, ``+detach`` where it cannot work. Called at attach and whenever the
        policy changes, so the news comes before the first training step."""
        if self.local_graphs:
            _cuda_graphs.check_policy(module, role)
        if self.full_graphs:
            _cuda_graphs.check_full_iteration_policy(module, role)
        if self.ep_overlap:
            _refusals.check_ep_overlap_policy(module, role)
        if self.detach_refusal is not None:
            _refusals.check_detach_policy(role, self.detach_refusal)
        else:
            _refusals.check_detach_clipping(module, role)
        if self.standalone:
            _refusals.check_standalone_policy(role)
        if not _capabilities.guards_empty_mtp_masks():
            _refusals.check_mask_policy(role)

    def _follow_mtp_stage(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Entry:
        """The entry of a loss stage of a standalone-MTP layout: its phase's decision, with run
        or skip taken from what the MTP stage did for this microbatch (:mod:`._standalone`)."""
        phase = _phases.explicit_phase.get()
        if phase is None:
            train = module.training and torch.is_grad_enabled()
            phase = _phases.Phase.TRAIN if train else _phases.Phase.EVAL
        entry = self._decide(module, phase)
        ran = _standalone.mtp_ran(module, args, kwargs, self.labels_at)
        if entry.run == ran:
            return entry
        # the MTP stage's decision was other than this stage's: do what it did, plainly
        return dataclasses.replace(
            entry,
            run=ran,
            loss_scale=None,
            metrics=False,
            detach=False,
            changes=None,
            masks=False,
            ignore_index=None,
            masking=False,
        )

    # -- helpers -------------------------------------------------------------------------------
    def _counters(self, phase: Any) -> list[int]:
        counters = self.counts.get(phase)
        if counters is None:  # threads deciding a new phase at once must share one list
            counters = self.counts.setdefault(phase, [0, 0, 0, 0, 0])
        return counters

    def __deepcopy__(self, memo: dict[int, Any]) -> GateState:
        """A gate of its own for a deep copy of the model (:func:`._calls.copy_gate`)."""
        copied: GateState = _calls.copy_gate(self, memo)
        return copied

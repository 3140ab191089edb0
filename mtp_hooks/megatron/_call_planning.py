"""The plan cache: what one forward call of a gated model is to do, before anything changes.

A call is left alone where it is an inference call (an inference context or parameters, or
megatron's inference mode), where the model has no MTP on this stage, and where the caller
passed ``compute_mtp_loss=False`` itself. Otherwise it gets its phase's plan
(:mod:`._phase_plan`): the phase named by the innermost :func:`mtp_hooks.phase` block, else
training or eval from ``module.training`` and autograd, planned once and reused until
something a decision depends on changes. A standalone MTP layout's loss stage does what its MTP
stage did for the microbatch (:mod:`._standalone`).

The planner also keeps what attach learned of the model's execution mode (CUDA graphs, DDP's
combined schedule, ``+detach``'s support, a tied stage) and a phase's counters, which
:meth:`mtp_hooks.AttachHandle.stats` reads. It changes nothing on the model: the gate
(:mod:`._gate`) applies the plan.
"""

from __future__ import annotations

import copy
import sys
from typing import Any, cast

import torch

from .. import _phases, _runtime, _sources
from .._forward_call import ForwardCall
from . import _capabilities, _cuda_graphs, _phase_counters, _phase_plan, _refusals, _standalone
from ._call_stack import CONFIG as _CONFIG
from ._call_stack import MTP_PROCESS as _MTP_PROCESS
from ._call_stack import Gates
from ._capabilities import NATIVE_FLAG as _NATIVE_FLAG
from ._phase_counters import UNTOUCHED as _UNTOUCHED
from ._phase_plan import PhasePlan

_grad_enabled = torch.is_grad_enabled
_explicit_phase = _phases.explicit_phase.get  # the innermost phase() block, or None
_TRAIN, _EVAL = _phases.Phase.TRAIN, _phases.Phase.EVAL


class CallPlanner:
    """Plans the calls of one gated model: its execution mode, its plans and counters by phase.

    Attributes:
        native: Whether the model's forward takes ``compute_mtp_loss`` (a skip passes it).
        tied_hazard: Whether a skip by the instance gates would break a tied-embedding stage.
        verify: Whether ranks check at every call that they agree (``MTP_HOOKS_VERIFY``).
        checks: Whether a call is planned afresh every time (``verify``, or local CUDA graphs,
            whose replays are checked per call).
        local_graphs, full_graphs, ep_overlap, detach_refusal, standalone: The execution mode
            (:class:`._refusals.ExecutionMode`).
        policy_checked: The snapshot version whose policy was last checked against the model.
        counts: The counters by phase (:mod:`._phase_counters`).
        cache: The plan by phase.
    """

    def __init__(self, model: torch.nn.Module, verify: bool) -> None:
        cls: Any = cast(Any, type(model))  # hashable for the capability caches
        self.native = _capabilities.native_flag(cls)
        self.inference_names, self.inference_positions = _capabilities.inference_arguments(cls)
        self.inference_from = min(self.inference_positions, default=sys.maxsize)
        mode = _capabilities.inference_mode_class()
        self.inference_active = None if mode is None else mode.is_active
        self.tied_hazard = not self.native and _capabilities.tied_mtp_stage(model)
        self.verify = verify
        graphs = _cuda_graphs.live_implementation(model)
        self.loss_stage = _standalone.loss_stage(model)  # follows the MTP stage
        self.standalone = _standalone.layout(model.config)
        self.labels_at = _capabilities.labels_position(cls)
        self.names = _capabilities.positional_names(cls)  # what a vote's call reads
        self.local_graphs = (
            graphs == "local" and not self.loss_stage and _cuda_graphs.mtp_layers_graphed(model)
        )
        self.full_graphs = graphs == "full_iteration"
        if self.full_graphs:
            _cuda_graphs.refuse_unfollowable_full_graphs()
        self.ep_overlap = bool(getattr(model.config, "overlap_moe_expert_parallel_comm", False))
        self.detach_refusal = _refusals.detach_refusal(model.config, graphs)
        self.checks = verify or self.local_graphs  # a per-call check: plan at every call
        self.start_fresh()

    def start_fresh(self) -> None:
        """No plan, no count and no policy checked yet: how a planner starts, and a deep
        copy's starts over."""
        self.policy_checked = -1
        self.counts: dict[Any, list[int]] = {}
        self.cache: dict[Any, PhasePlan] = {}

    def copied(self) -> CallPlanner:
        """A planner for a deep copy of the model: the same execution mode, started afresh."""
        new = copy.copy(self)
        new.start_fresh()
        return new

    def plan_call(
        self,
        module: torch.nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        base: Gates | None,
    ) -> PhasePlan | None:
        """The plan of this call's phase, or ``None`` to leave MTP alone (inference, MTP off,
        the caller's own ``compute_mtp_loss=False``). ``base``: the model's own gates where a
        running call has set others on it (nesting, another thread), else ``None``.

        Raises:
            UnsupportedModelError: The policy asks for what this model cannot do.
            MTPHooksError: A plugin's answer, or a rank disagreement, for this phase.
        """
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
            self.counters("inference")[_UNTOUCHED] += 1
            return None
        if base is not None:  # the gates a running call set are not this call's
            mtp_process, config = base[_MTP_PROCESS], base[_CONFIG]
        else:
            mtp_process, config = module.mtp_process, module.config
        phase = _explicit_phase()
        if phase is None:
            phase = _TRAIN if module.training and _grad_enabled() else _EVAL
        if not (mtp_process and config.mtp_num_layers):  # MTP is off, or on another stage
            if not self.loss_stage:
                return None
            # a loss stage: its phase's plan, run or skip as the MTP stage did (never +metrics)
            plan = _phase_plan.plan(self, module, phase, ForwardCall(args, kwargs, self.names))
            ran = _standalone.mtp_ran(module, args, kwargs, self.labels_at)
            if plan.run != ran:  # the MTP stage decided otherwise: do what it did, plainly
                plan = plan.plainly(ran)
        else:
            cached = self.cache.get(phase)
            runtime = _runtime.current  # while watching, refresh() reads the sources
            policy = _sources.refresh() if runtime.watching else runtime.snapshot
            if cached is None or cached.version != policy.version or self.checks:
                plan = _phase_plan.plan(self, module, phase, ForwardCall(args, kwargs, self.names))
            else:
                plan = cached
        if self.native and plan.run and kwargs.get(_NATIVE_FLAG) is False:
            # The caller turned MTP off for this call itself: its keyword wins, as an inference
            # call's does, and a plan that asks more of the call than a skip is refused. Under a
            # skip the plan goes on, its flag agreeing: the False may be an outer model's skip
            # handed on with the keywords (ModelOpt runs its teacher inside the student's
            # forward), and the skip must still hide the MTP depths from megatron's config.
            _refusals.check_callers_own_skip(module, plan)
            plan.counters[_UNTOUCHED] += 1
            return None
        return plan

    def counters(self, phase: Any) -> list[int]:
        """The counters of ``phase`` (made at its first call)."""
        counters = self.counts.get(phase)
        if counters is None:  # threads planning a new phase at once must share one list
            counters = self.counts.setdefault(phase, _phase_counters.new_counters())
        return counters

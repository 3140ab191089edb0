"""A phase's plan: the decision for one model and phase, turned into what the hooks do.

A gate plans each phase once and reuses the plan for as long as nothing a decision depends on
changes (``_runtime.current.generation``), unless a per-call check is on. Planning also checks
what the decision asks of this model (``+detach`` where it cannot work, rank agreement,
CUDA-graph replays), so a refusal comes before the forward changes anything.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Final, Protocol

from .. import _decision, _phases, _roles, _sources
from .._errors import about
from .._forward_call import ForwardCall
from .._plugin_registry import registry
from .._policy_entry import plan_fields
from . import _cuda_graphs, _rank_agreement, _refusals
from ._call_extensions import Kind
from ._config_view import Changes
from ._loss_masking import LossMasks
from .drafting._objectives import Objectives
from .drafting._recorder import Recorder

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass(slots=True)
class PhasePlan:
    """What the hooks do at a call of one phase. Never changed once made (plans are shared by
    every call of the phase); slots, not a frozen class or a named tuple, because the hooks
    read five fields per call and a frozen class costs five times as much to build, once per
    forward for plugins asked at every forward (docs/benchmarks.md)."""

    phase: Any
    """The phase it plans."""
    generation: int
    """The runtime generation it was made at (:mod:`mtp_hooks._runtime`)."""
    run: bool
    """Whether MTP runs."""
    counters: list[int]
    """The phase's counters (:data:`._phase_counters.COUNTED`), counted in place."""
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
    objective: tuple[str, float] | None = None
    """``(kind, temperature)`` when MTP trains toward the policy (``+objective:kl``): megatron's
    own weight is 0 for the call and :mod:`.drafting._objectives` adds the objective, else
    ``None``."""
    extensions: tuple[Kind, ...] = ()
    """The per-call extensions its calls begin, in order (:mod:`._call_extensions`): the mask
    (``masking``), then ``+metrics``' recorder, then ``+objective``'s objectives (read per
    call)."""

    def plainly(self, run: bool) -> PhasePlan:
        """This plan with ``run`` and none of its options: what a standalone layout's loss
        stage does when the MTP stage decided otherwise for a microbatch."""
        plain: dict[str, Any] = {option.field: option.plain for option in OPTIONS}
        return dataclasses.replace(self, run=run, **plain, **DERIVED)

    def options(self, needing_a_run: bool = False) -> list[str]:
        """What this plan asks beyond a plain run or skip, as :data:`OPTIONS` names it; with
        ``needing_a_run``, only what a call that does not run MTP would leave undone."""
        return [
            option.says
            for option in OPTIONS
            if getattr(self, option.field) != option.plain
            and (option.needs_a_run or not needing_a_run)
        ]


OPTIONS: Final = plan_fields()
"""Every option a plan carries, as each policy option declares its plan fields
(:data:`mtp_hooks._policy_entry.OPTIONS`). A check that must refuse anything but a plain run
reads this list, so an option declared there is refused there too
(tests/adapters/test_ep_overlap.py fails on a plan field that is in neither this list,
:data:`DERIVED` nor :data:`BOOKKEEPING`)."""

DERIVED: Final[dict[str, Any]] = {"changes": None, "masking": False, "extensions": ()}
"""Plan fields that follow from :data:`OPTIONS` (the config fields to change, whether a call
masks, the per-call extensions it begins), at their plain values."""

BOOKKEEPING: Final = ("phase", "generation", "run", "counters")
"""Plan fields that are not options."""


class Planner(_refusals.ExecutionMode, Protocol):
    """What planning reads and keeps (:class:`._call_planning.CallPlanner` has these)."""

    verify: bool
    policy_checked: int
    cache: dict[Any, PhasePlan]

    def counters(self, phase: Any) -> list[int]: ...


def check_policy(gate: Planner, module: torch.nn.Module, role: str | None) -> None:
    """What the model's execution mode cannot follow (:func:`._refusals.check_policy`), and
    under megatron's combined 1F1B schedule anything but a plain run in training.

    With ``overlap_moe_expert_parallel_comm=True`` megatron builds every training microbatch
    through ``build_schedule_plan``, which calls no forward hook and includes the MTP layers
    whenever the model has them (megatron-core 0.19.2, ``model_chunk_schedule_plan.py``), so
    no training decision or option reaches it; forward-only passes take ``forward`` and follow
    the policy. The check reads :data:`OPTIONS`, so no option can slip past it.
    """
    with about(role=role):  # each refusal is of this model's (role's) policy
        if gate.ep_overlap:
            decision, _ = _decision.decide_normalized(module, _phases.Phase.TRAIN, role)
            training = _made(_phases.Phase.TRAIN, _sources.refresh(), [], decision)
            asked = training.options()
            if not training.run or asked:
                _refusals.refuse_ep_overlap("skip" if not training.run else " and ".join(asked))
        _refusals.check_policy(gate, module, role)


def plan(
    gate: Planner, module: torch.nn.Module, phase: Any, call: ForwardCall | None = None
) -> PhasePlan:
    """Decide for ``gate``'s model in ``phase`` and plan the calls; cache the plan when the
    decision may be reused. ``call``: the forward being planned, for votes that read it.

    Raises:
        UnsupportedModelError: The policy asks for what this model cannot do.
        DecisionMismatchError: Ranks that must agree did not (``verify``).
    """
    generation = _sources.refresh()
    role = _roles.role_of(module)
    if gate.policy_checked != generation:
        check_policy(gate, module, role)
        gate.policy_checked = generation
    decision, cacheable = _decision.decide_normalized(module, phase, role, call)
    if gate.verify and not (gate.full_graphs and _cuda_graphs.capturing()):
        _rank_agreement.verify(decision, phase)  # host syncs: never inside a capture
    if gate.local_graphs and decision.run:
        _cuda_graphs.check_replayable(module)
    if decision.run and decision.objective is not None:
        _refusals.check_objective(gate, str(phase))
    if decision.run and decision.detach:
        refusal = gate.detach_refusal or _refusals.clipping_refusal(module)
        if refusal is not None:
            by = decision.detach_by
            by = "the policy config" if by == "config" else f"plugin {by}"
            _refusals.refuse_detach(str(phase), by, refusal)
    made = _made(phase, generation, gate.counters(phase), decision)
    if cacheable:
        gate.cache[phase] = made
    return made


def _made(phase: Any, generation: int, counters: list[int], decision: Any) -> PhasePlan:
    """The plan of ``decision`` (a :class:`~mtp_hooks._decision.Decision`), unchecked."""
    changes: list[tuple[str, Any]] = []
    objective = None
    if decision.run and decision.objective is not None:
        objective = (decision.objective, decision.temperature)
        changes.append(("mtp_loss_scaling_factor", 0.0))  # megatron's cross-entropy adds nothing
    elif decision.run and decision.loss_scale is not None:
        changes.append(("mtp_loss_scaling_factor", decision.loss_scale))
    if decision.run and decision.detach:
        changes.append(("mtp_detach_heads", True))
    masks = decision.run and decision.plugin_masks and registry().implements("mtp_loss_mask")
    ignore = decision.ignore_index if decision.run and decision.mask == "labels" else None
    masking = masks or ignore is not None
    extensions: tuple[Kind, ...] = ()
    if masking or decision.metrics or objective is not None:  # a plan per forward where a
        # plugin is asked at every forward: the plain plan builds nothing here
        ordered = (LossMasks, masking), (Recorder, decision.metrics), (Objectives, objective)
        extensions = tuple(kind for kind, asked in ordered if asked)
    return PhasePlan(
        phase=phase,
        generation=generation,
        run=decision.run,
        counters=counters,
        loss_scale=decision.loss_scale,
        metrics=decision.metrics,
        detach=decision.run and decision.detach,
        changes=tuple(changes) or None,
        masks=masks,
        ignore_index=ignore,
        masking=masking,
        objective=objective,
        extensions=extensions,
    )

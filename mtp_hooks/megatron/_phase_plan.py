"""A phase's plan: the decision for one model and phase, turned into what the hooks do.

A gate plans each phase once and reuses the plan for as long as nothing a decision depends on
changes (``_runtime.current.generation``), unless a per-call check is on. Planning also checks
what the decision asks of this model (``+detach`` where it cannot work, rank agreement,
CUDA-graph replays), so a refusal comes before the forward changes anything.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Final, Protocol

from .. import _decision, _roles, _sources
from .._plugin_registry import registry
from . import _cuda_graphs, _rank_agreement, _refusals
from ._config_view import Changes

if TYPE_CHECKING:
    import torch

# A phase's counters, one list per (gate, phase) counted in place: the slots and their names.
RUN, SKIP, UNTOUCHED, DETACHED, MASKED = range(5)
COUNTED: Final = ("run", "skip", "untouched", "detached", "masked")


def new_counters() -> list[int]:
    """A phase's counters, all zero (:data:`COUNTED` names the slots)."""
    return [0] * len(COUNTED)


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
    """The phase's counters (:data:`COUNTED`), counted in place."""
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
    own weight is 0 for the call and :mod:`._objectives` adds the objective, else ``None``."""
    hooked: bool = False
    """``metrics`` or ``objective``: the call opens a hook of its own (read per call)."""

    def plainly(self, run: bool) -> PhasePlan:
        """This plan with ``run`` and none of its options: what a standalone layout's loss
        stage does when the MTP stage decided otherwise for a microbatch."""
        return dataclasses.replace(
            self,
            run=run,
            loss_scale=None,
            metrics=False,
            detach=False,
            changes=None,
            masks=False,
            ignore_index=None,
            masking=False,
            objective=None,
            hooked=False,
        )


class Planner(_refusals.ExecutionMode, Protocol):
    """What planning reads and keeps on a gate (``MTPGate`` has these)."""

    verify: bool
    policy_checked: int
    cache: dict[Any, PhasePlan]

    def counters(self, phase: Any) -> list[int]: ...


def plan(gate: Planner, module: torch.nn.Module, phase: Any) -> PhasePlan:
    """Decide for ``gate``'s model in ``phase`` and plan the calls; cache the plan when the
    decision may be reused.

    Raises:
        UnsupportedModelError: The policy asks for what this model cannot do.
        DecisionMismatchError: Ranks that must agree did not (``verify``).
    """
    generation = _sources.generation()
    role = _roles.role_of(module)
    if gate.policy_checked != generation:
        _refusals.check_policy(gate, module, role)
        gate.policy_checked = generation
    decision, cacheable = _decision.decide_normalized(module, phase, role)
    if gate.verify and not (gate.full_graphs and _cuda_graphs.capturing()):
        _rank_agreement.verify(decision, phase)  # host syncs: never inside a capture
    if gate.local_graphs and decision.run:
        _cuda_graphs.check_replayable(module)
    changes: list[tuple[str, Any]] = []
    objective = None
    if decision.run and decision.objective is not None:
        _refusals.check_objective(gate, str(phase))
        objective = (decision.objective, decision.temperature)
        changes.append(("mtp_loss_scaling_factor", 0.0))  # megatron's cross-entropy adds nothing
    elif decision.run and decision.loss_scale is not None:
        changes.append(("mtp_loss_scaling_factor", decision.loss_scale))
    if decision.run and decision.detach:
        refusal = gate.detach_refusal or _refusals.clipping_refusal(module)
        if refusal is not None:
            by = decision.detach_by
            by = "the policy config" if by == "config" else f"plugin {by}"
            _refusals.refuse_detach(str(phase), by, refusal)
        changes.append(("mtp_detach_heads", True))
    masks = decision.run and decision.plugin_masks and registry().implements("mtp_loss_mask")
    ignore = decision.ignore_index if decision.run and decision.mask == "labels" else None
    made = PhasePlan(
        phase=phase,
        generation=generation,
        run=decision.run,
        counters=gate.counters(phase),
        loss_scale=decision.loss_scale,
        metrics=decision.metrics,
        detach=decision.run and decision.detach,
        changes=tuple(changes) or None,
        masks=masks,
        ignore_index=ignore,
        masking=masks or ignore is not None,
        objective=objective,
        hooked=decision.metrics or objective is not None,
    )
    if cacheable:
        gate.cache[phase] = made
    return made

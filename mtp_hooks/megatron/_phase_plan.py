"""A phase's plan: the decision for one model and phase, turned into what the hooks do.

A gate plans each phase once and reuses the plan for as long as nothing a decision depends on
changes (the version of the policy snapshot, ``_runtime.current.snapshot``), unless a per-call
check is on. Planning also checks
what the decision asks of this model (``+detach`` where it cannot work, rank agreement,
CUDA-graph replays), so a refusal comes before the forward changes anything.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Any, Protocol

from .. import _decision, _options, _phases, _roles, _sources
from .._errors import about
from .._forward_call import ForwardCall
from .._options import NOTHING, Options
from .._plugin_registry import registry
from . import _cuda_graphs, _rank_agreement, _refusals
from ._call_extensions import Kind
from ._config_view import Changes

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
    version: int
    """The version of the policy snapshot it was made at (:mod:`mtp_hooks._policy_snapshot`)."""
    run: bool
    """Whether MTP runs."""
    counters: list[int]
    """The phase's counters (:data:`._phase_counters.COUNTED`), counted in place."""
    options: Options
    """What the policy options decided for a call that runs MTP (a skip's are plain), which
    the per-call extensions read."""
    changes: Changes | None
    """The config fields a call that runs MTP changes (a loss weight, ``+detach``), or
    ``None``: what the options' plan parts change, later options winning."""
    into_layers: bool
    """Whether the changes also reach the MTP block's and layers' own configs (``+detach``)."""
    extensions: tuple[Kind, ...]
    """The per-call extensions its calls begin, in the order they begin (:func:`kinds`)."""

    def plainly(self, run: bool) -> PhasePlan:
        """This plan with ``run`` and none of its options: what a standalone layout's loss
        stage does when the MTP stage decided otherwise for a microbatch."""
        return _plain(self.phase, self.version, run, self.counters)

    def asked(self, needing_a_run: bool = False) -> list[str]:
        """What this plan asks beyond a plain run or skip, as the options name it; with
        ``needing_a_run``, only what a call that does not run MTP would leave undone."""
        if not self.run:
            return []
        implements = registry().implements
        per_option = _options.each("asked", lambda option: option.asked(self.options, implements))
        return [
            asked.says
            for of_one in per_option
            for asked in of_one
            if asked.needs_a_run or not needing_a_run
        ]


def kinds(asking: list[_options.Option]) -> tuple[Kind, ...]:
    """The per-call extension kinds of the options in ``asking``, in the order a call begins
    them: those that only prepare the call (``ends`` false: a mask, set in the call's keyword
    arguments) first, since the others read what they set (metrics read the mask), then the
    rest in the options' order.

    Raises:
        LookupError: An option asks for an extension but names none, or a name that does
            not import; nothing is planned then.
    """
    # imported at each plan, not kept here: a plan is made once per phase and policy version,
    # and sys.modules already keeps the module (a reset may bring another option of one name)
    made = [_imported(option) for option in asking]
    # ``ends`` is a class attribute of each kind (CallExtension.ends), read before any exists
    return tuple(sorted(made, key=lambda kind: bool(getattr(kind, "ends", True))))


def _imported(option: _options.Option) -> Kind:
    module, _, name = option.extension.partition(":")
    try:
        kind: Kind = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        where = f"{option.extension!r} ({exc})" if option.extension else "none"
        raise LookupError(
            f"mtp_hooks: option {option.name!r} asks for a per-call extension, but its "
            f"extension names {where}; set {type(option).__name__}.extension to the kind's "
            '"module:Class"'
        ) from exc
    return kind


def _plain(phase: Any, version: int, run: bool, counters: list[int]) -> PhasePlan:
    return PhasePlan(phase, version, run, counters, _options.plain(), None, False, ())


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
    the policy. The check reads what every option asks, so no option can slip past it.
    """
    with about(role=role):  # each refusal is of this model's (role's) policy
        if gate.ep_overlap:
            decision, _ = _decision.decide_normalized(module, _phases.Phase.TRAIN, role)
            training = _made(_phases.Phase.TRAIN, _sources.refresh().version, [], decision)
            asked = training.asked()
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
    version = _sources.refresh().version
    role = _roles.role_of(module)
    if gate.policy_checked != version:
        check_policy(gate, module, role)
        gate.policy_checked = version
    decision, cacheable = _decision.decide_normalized(module, phase, role, call)
    if gate.verify and not (gate.full_graphs and _cuda_graphs.capturing()):
        _rank_agreement.verify(decision, phase)  # host syncs: never inside a capture
    if gate.local_graphs and decision.run:
        _cuda_graphs.check_replayable(module)
    if decision.run and (gate.full_graphs or gate.standalone):  # a plain layout asks nothing
        _refusals.check_layout(gate, str(phase), decision.options)
    if decision.run and decision.options.detach:
        refusal = gate.detach_refusal or _refusals.clipping_refusal(module)
        if refusal is not None:
            by = decision.options.by("detach")
            by = "the policy config" if by == "config" else f"plugin {by}"
            _refusals.refuse_detach(str(phase), by, refusal)
    made = _made(phase, version, gate.counters(phase), decision)
    if cacheable:
        gate.cache[phase] = made
    return made


def _made(phase: Any, version: int, counters: list[int], decision: Any) -> PhasePlan:
    """The plan of ``decision`` (a :class:`~mtp_hooks._decision.Decision`), unchecked: what
    each option's plan part changes (:meth:`mtp_hooks._options.Option.plan`)."""
    if not decision.run:
        return _plain(phase, version, False, counters)
    options, implements = decision.options, registry().implements
    changes: dict[str, Any] = {}
    into_layers = False
    asking: list[_options.Option] = []
    plain = options is _options.plain()  # most plans: only an option that plans at its plain
    # values is asked (a plugin asked at every forward makes a plan at every forward)
    in_force = _options.options()
    try:
        for option in in_force:
            if plain and not option.plans_when_plain:
                continue
            part = option.plan(options, implements)
            if part is NOTHING:
                continue
            changes.update(part.changes)
            into_layers = into_layers or part.into_layers
            if part.extension:
                asking.append(option)
    except Exception as exc:
        _options.reraise(option, "plan", exc)
    # a plan per forward where a plugin is asked at every forward: the plain plan asks nothing
    extensions = kinds(asking) if asking else ()
    return PhasePlan(
        phase,
        version,
        True,
        counters,
        options,
        tuple(changes.items()) or None,
        into_layers,
        extensions,
    )

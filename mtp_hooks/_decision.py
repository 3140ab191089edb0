"""The combination rule: config first, then plugin votes, then the model's own default.

1. If the policy config names the model's (role, phase) with ``run`` or ``skip``, that is final
   (``kind="config"``). A role-scoped entry beats a plain phase entry; ``auto`` defers to 2.
2. Otherwise every plugin votes; ``None`` abstains. Agreeing votes decide (``kind="plugins"``,
   ``voters`` names them); disagreeing votes raise :class:`PolicyConflictError`.
3. With no votes, MTP runs (``kind="default"``), which is what Megatron does on its own.

The outcome never depends on pluggy's call order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any, Literal

from . import _phase_catalogue, _phases, _policy_entry, _roles, _runtime, _sources
from ._errors import MTPHooksError, PolicyConflictError, PolicyError
from ._forward_call import ForwardCall
from ._plugin_registry import registry as _registry
from ._policy_entry import PolicyEntry

logger = logging.getLogger("mtp_hooks")


_NO_VOTES: Mapping[str, bool | None] = MappingProxyType({})


@dataclass(frozen=True, kw_only=True)
class Decision:
    """The outcome of :func:`decide` for one model and phase.

    Attributes:
        run: Whether MTP runs.
        kind: What decided: ``"config"``, ``"plugins"`` or ``"default"``.
        voters: The plugins whose (agreeing) votes decided, for ``kind="plugins"``; else empty.
        votes: Each consulted plugin's vote (``True``, ``False`` or ``None``), by plugin name,
            read-only: decisions are cached and shared. Empty when the config decided, since
            plugins are not consulted then.
        phase: The phase decided for.
        role: The model's role, or ``None``.
        source: Where a config decision came from (``mtp_hooks.configure()``, an env var or a
            file), else ``None``.
        loss_scale: The MTP loss weight this forward uses when MTP runs, from the config
            (``run:0.3``) or from plugins' ``mtp_loss_scale``; ``None``: the model's own.
        loss_scale_by: Who gave ``loss_scale``: ``"config"`` or the plugins' names, else ``None``.
        metrics: Whether this forward records MTP loss and acceptance (a ``+metrics`` policy
            entry, and MTP runs).
        detach: Whether MTP runs on detached inputs, so that its loss trains only the MTP
            weights (``+detach``, or plugins' ``mtp_detach_heads``); ``False``: the model's own
            ``mtp_detach_heads``.
        detach_by: Who set ``detach``: ``"config"`` or the plugins' names, else ``None``.
        mask: ``"labels"`` when the policy config keeps this forward's MTP loss off positions
            whose label is ``ignore_index`` (``+mask:labels``), else ``None``.
        ignore_index: The label that ``mask="labels"`` leaves out.
        plugin_masks: Whether plugins' ``mtp_loss_mask`` answers apply (the config's
            ``plugin_masks = false`` turns them off).
        objective: ``"kl"`` or ``"tv"`` when this forward trains MTP toward the policy's own
            next-token distribution (``+objective:kl``), else ``None``: megatron's
            cross-entropy against the labels.
        temperature: The temperature of both distributions under ``objective``.
        objective_by: Who set ``objective``: ``"config"`` or the plugins' names, else ``None``.
    """

    run: bool
    kind: Literal["config", "plugins", "default"]
    voters: tuple[str, ...] = ()
    votes: Mapping[str, bool | None] = field(default_factory=lambda: _NO_VOTES)
    phase: _phases.Phase | str | None = None
    role: str | None = None
    source: str | None = None
    loss_scale: float | None = None
    loss_scale_by: str | None = None
    metrics: bool = False
    detach: bool = False
    detach_by: str | None = None
    mask: str | None = None
    ignore_index: int = _policy_entry.IGNORE_INDEX
    plugin_masks: bool = True
    objective: str | None = None
    temperature: float = 1.0
    objective_by: str | None = None

    @property
    def decided_by(self) -> str:
        """``kind``, or for plugins their names joined by commas, for display (a plugin may be
        named ``default``; compare ``kind`` and ``voters`` instead)."""
        return ",".join(self.voters) if self.kind == "plugins" else self.kind


def _conflict(what: str, role: str | None, phase: str, listed: str, settle: tuple[str, str]) -> str:
    """The message of a :class:`PolicyConflictError`: who said what, and how to settle it."""
    key = f"{role}.{phase}" if role else phase
    return (
        f"plugins disagree on {what} for phase {phase!r}"
        + (f" and role {role!r}" if role else "")
        + f": {listed}. Settle it in the policy config, e.g. "
        f"mtp_hooks.configure('{key}={settle[0]}') or MTP_HOOKS_POLICY={key}={settle[1]}."
    )


def _agreeing(
    answers: Any, what: str, role: str | None, phase: Any, settle: str, hook: str, show: str = ""
) -> dict[str, Any]:
    """Plugins' ``(name, answer)`` pairs by name, once they all give one answer; else a
    :class:`PolicyConflictError` listing each (formatted with ``show``) and the setting to
    settle it with."""
    by_name = dict(sorted(answers))
    if len(set(by_name.values())) > 1:
        listed = ", ".join(f"{name}={answer:{show}}" for name, answer in by_name.items())
        error = PolicyConflictError(
            _conflict(what, role, str(phase), listed, (settle, settle)), hook=hook
        )
        error.answers = dict(by_name)  # a record to read, and to pickle
        raise error
    return by_name


def _with_plugin_loss_scale(
    decision: Decision, model: Any, phase: Any, role: str | None
) -> Decision:
    scales = _agreeing(
        _registry().loss_scales(model, phase),
        "the MTP loss weight",
        role,
        phase,
        "run:0.1",
        "mtp_loss_scale",
        "g",
    )
    if not scales:
        return decision
    weight = next(iter(scales.values()))
    return replace(decision, loss_scale=weight, loss_scale_by=",".join(scales))


def _with_plugin_objective(
    decision: Decision, model: Any, phase: Any, role: str | None
) -> Decision:
    answers = _agreeing(
        _registry().objective_answers(model, phase),
        "the MTP objective",
        role,
        phase,
        "run+detach+objective:kl",
        "mtp_objective",
    )
    objective = next(iter(answers.values()), "ce")
    if objective == "ce":
        return decision
    names = ",".join(answers)
    if not decision.detach:
        raise PolicyError(
            plugin=names,
            hook="mtp_objective",
            option=f"+objective:{objective}",
            message=f"plugin {names} asks MTP to train toward the policy's own distribution "
            f"(objective {objective!r}) in phase {str(phase)!r}, which must never train the trunk, "
            "but this forward is not detached. Detach it (the policy's '+detach', or a plugin's "
            "mtp_detach_heads), or answer 'ce'",
        )
    return replace(decision, objective=objective, objective_by=names)


def _with_plugin_detach(decision: Decision, model: Any, phase: Any, role: str | None) -> Decision:
    answers = _agreeing(
        _registry().detach_votes(model, phase),
        "detaching MTP",
        role,
        phase,
        "run+detach",
        "mtp_detach_heads",
    )
    if not any(answers.values()):
        return decision
    return replace(decision, detach=True, detach_by=",".join(answers))


Step = Callable[[Decision, PolicyEntry | None, Any, Any, str | None], tuple[Decision, bool]]
"""An option's part of a decision that runs MTP: ``step(decision, entry, model, phase, role)``
sets the option's decision fields from the policy entry (``None``: none for this key) or the
plugins, and says whether the result may still be cached (an answer asked of plugins at every
forward may not)."""


def _loss_scale(
    decision: Decision, entry: PolicyEntry | None, model: Any, phase: Any, role: str | None
) -> tuple[Decision, bool]:
    if entry is not None and entry.loss_scale is not None:
        return replace(decision, loss_scale=entry.loss_scale, loss_scale_by="config"), True
    if _registry().implements("mtp_loss_scale"):
        return _with_plugin_loss_scale(decision, model, phase, role), False  # may follow the step
    return decision, True


def _metrics(
    decision: Decision, entry: PolicyEntry | None, model: Any, phase: Any, role: str | None
) -> tuple[Decision, bool]:
    if entry is not None and entry.metrics:
        return replace(decision, metrics=True), True
    return decision, True


def _detach(
    decision: Decision, entry: PolicyEntry | None, model: Any, phase: Any, role: str | None
) -> tuple[Decision, bool]:
    if entry is not None and entry.detach is not None:
        if entry.detach:
            return replace(decision, detach=True, detach_by="config"), True
        return decision, True  # detach = false: the model's own setting, whatever plugins say
    if _registry().implements("mtp_detach_heads"):
        # an answer may follow the drafter's acceptance
        return _with_plugin_detach(decision, model, phase, role), False
    return decision, True


def _mask(
    decision: Decision, entry: PolicyEntry | None, model: Any, phase: Any, role: str | None
) -> tuple[Decision, bool]:
    if entry is not None and (entry.mask is not None or entry.plugin_masks is False):
        ignore = _policy_entry.IGNORE_INDEX if entry.ignore_index is None else entry.ignore_index
        masked = replace(
            decision,
            mask=entry.mask,
            ignore_index=ignore,
            plugin_masks=entry.plugin_masks is not False,
        )
        return masked, True
    return decision, True


def _objective(
    decision: Decision, entry: PolicyEntry | None, model: Any, phase: Any, role: str | None
) -> tuple[Decision, bool]:
    if entry is not None and entry.objective is not None:
        if entry.objective == "ce":
            return decision, True
        temperature = 1.0 if entry.temperature is None else entry.temperature
        objective = replace(
            decision, objective=entry.objective, temperature=temperature, objective_by="config"
        )
        return objective, True
    if _registry().implements("mtp_objective"):
        # an answer may follow the policy's entropy
        return _with_plugin_objective(decision, model, phase, role), False
    return decision, True


STEPS: Mapping[str, Step] = MappingProxyType(
    {
        "loss_scale": _loss_scale,
        "metrics": _metrics,
        "detach": _detach,
        "mask": _mask,
        "objective": _objective,
    }
)
"""Each policy option's step of a decision that runs MTP, by option name, taken in the order
of :data:`mtp_hooks._policy_entry.OPTIONS` (``objective`` reads what ``detach`` decided)."""


def _reused_votes(model: Any, role: str | None, phase: Any) -> Decision | None:
    """The plugins' decision for ``model`` in ``phase`` kept by :func:`_keep_votes` at this
    generation, if any: cacheable votes are asked once even where an option's plugin answer
    (a ``mtp_loss_scale``) is asked at every forward."""
    try:
        kept = _runtime.current.votes_memo.get(model)
    except TypeError:  # a model that cannot be held weakly: never kept
        return None
    return None if kept is None else kept.get((role, phase))


def _keep_votes(model: Any, role: str | None, phase: Any, decision: Decision) -> None:
    try:
        _runtime.current.votes_memo.setdefault(model, {})[(role, phase)] = decision
    except TypeError:
        pass


def _plugin_decision(
    model: Any, phase: Any, role: str | None, call: ForwardCall | None
) -> Decision:
    votes = MappingProxyType(dict(sorted(_registry().votes(model, phase, call))))
    cast = {v for v in votes.values() if v is not None}
    if len(cast) > 1:
        listed = ", ".join(
            f"{name}={'run' if v else 'skip'}" for name, v in votes.items() if v is not None
        )
        error = PolicyConflictError(
            _conflict("MTP", role, str(phase), listed, ("run", "skip")), hook="should_run_mtp"
        )
        error.answers = {n: v for n, v in votes.items() if v is not None}
        raise error
    if cast:
        voters = tuple(name for name, v in votes.items() if v is not None)
        return Decision(
            run=cast.pop(), kind="plugins", voters=voters, votes=votes, phase=phase, role=role
        )
    return Decision(run=True, kind="default", votes=votes, phase=phase, role=role)


def _options_set(decision: Decision) -> list[tuple[str, Any]]:
    """The decision fields the policy options set away from their defaults, in declaration
    order: what a traced decision logs beyond who decided."""
    defaults = {f.name: f.default for f in fields(Decision)}
    return [
        (name, getattr(decision, name))
        for option in _policy_entry.OPTIONS
        for name in option.decision_fields
        if getattr(decision, name) != defaults[name]
    ]


def decide(model: Any, phase: _phases.Phase | str) -> Decision:
    """Decide whether ``model`` runs MTP in ``phase``, by the combination rule above.

    Args:
        model: The model (its role is read with :func:`mtp_hooks.role_of`), or ``None``.
        phase: A :class:`mtp_hooks.Phase` or a declared phase name.

    Raises:
        PolicyError: Unknown phase, malformed config source, or a plugin returned a non-bool.
        PolicyConflictError: Plugins disagree and the config does not settle it.
        PluginError: A plugin's ``should_run_mtp`` raised; the original error is chained.

    Example:
        >>> import mtp_hooks
        >>> mtp_hooks.configure("eval=skip")
        >>> mtp_hooks.decide(None, "eval").run
        False
    """
    canonical = _phase_catalogue.normalize(phase, "mtp_hooks.decide()")
    return decide_normalized(model, canonical, _roles.role_of(model))[0]


def decide_normalized(
    model: Any, phase: _phases.Phase | str, role: str | None, call: ForwardCall | None = None
) -> tuple[Decision, bool]:
    """:func:`decide` for a phase already normalized; also says whether the result may be cached.
    ``call``: the forward being decided, which plugins' votes may read.

    A decision may be reused for this model and phase until the runtime's ``generation``
    changes when no plugin was consulted (the config decided, or no plugin implements
    ``should_run_mtp``) or every plugin that votes is a ``cacheable_vote`` and none read the
    forward call, and no ``mtp_loss_scale`` plugin gave its weight. Cacheable votes are kept
    per model and phase even where such a weight is asked again (:func:`_reused_votes`). Only
    decisions that consulted no plugin are also shared across models of one role (a vote may
    depend on the model).
    """
    generation = _sources.refresh()
    runtime = _runtime.current
    memo = runtime.memo
    if runtime.memo_generation != generation:
        memo.clear()
        runtime.votes_memo.clear()
        runtime.memo_generation = generation
    decision = memo.get((role, phase))
    if decision is not None:
        return decision, True
    try:
        return _decide(model, phase, role, memo, call)
    except MTPHooksError as error:  # a plugin's answer, or a refusal: name the phase and role
        error.fill(phase=str(phase), role=role)
        raise


def _decide(
    model: Any,
    phase: _phases.Phase | str,
    role: str | None,
    memo: dict[Any, Decision],
    call: ForwardCall | None,
) -> tuple[Decision, bool]:
    """:func:`decide_normalized` where its memo holds no decision."""
    tracing = _sources.tracing()
    entry = _sources.lookup(role, str(phase))
    if entry is not None and entry.value != "auto":
        decision = Decision(
            run=entry.value == "run", kind="config", phase=phase, role=role, source=entry.source
        )
        shared = True
        cacheable = not tracing  # a traced decision is logged at every call
    else:
        reusable = _registry().votes_cacheable() and not tracing
        kept = _reused_votes(model, role, phase) if reusable else None
        if kept is not None:
            decision = kept
        else:
            decision = _plugin_decision(model, phase, role, call)
            if call is not None and call.read:  # a vote followed this call's arguments
                reusable = False
            if reusable:
                _keep_votes(model, role, phase, decision)
        shared = not decision.votes
        cacheable = (shared or reusable) and not tracing
    if decision.run:
        implements = _registry().implements
        for option in _policy_entry.OPTIONS:
            if entry is not None or (option.hook is not None and implements(option.hook)):
                decision, fresh = STEPS[option.name](decision, entry, model, phase, role)
                cacheable = cacheable and fresh
    if cacheable and shared:
        memo[(role, phase)] = decision  # a pure function of (role, phase) until a change
    if tracing:
        logger.info(
            "mtp_hooks decision: phase=%s role=%s votes=%s run=%s decided_by=%s%s%s",
            phase,
            role,
            dict(decision.votes),
            decision.run,
            decision.decided_by,
            f" source={decision.source}" if decision.source else "",
            "".join(f" {name}={value}" for name, value in _options_set(decision)),
        )
    return decision, cacheable

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
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Literal

from . import _option_base, _options, _phase_catalogue, _phases, _roles, _runtime, _sources
from ._errors import MTPHooksError, PolicyConflictError
from ._forward_call import ForwardCall
from ._option_base import Ask, Options
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
        options: What the policy options decided for a forward that runs MTP
            (:class:`mtp_hooks.Options`), read by field: ``options.loss_scale`` (``None``:
            the model's own weight), ``options.detach``, ``options.objective`` and the others
            the user guide gives with each option; ``options.by("detach")`` says who set one
            (``"config"`` or the plugins' names). A skip's are plain.
    """

    run: bool
    kind: Literal["config", "plugins", "default"]
    voters: tuple[str, ...] = ()
    votes: Mapping[str, bool | None] = field(default_factory=lambda: _NO_VOTES)
    phase: _phases.Phase | str | None = None
    role: str | None = None
    source: str | None = None
    options: Options = field(default_factory=_options.plain)

    @property
    def decided_by(self) -> str:
        """``kind``, or for plugins their names joined by commas, for display (a plugin may be
        named ``default``; compare ``kind`` and ``voters`` instead)."""
        return ",".join(self.voters) if self.kind == "plugins" else self.kind


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
            _option_base.conflict("MTP", role, str(phase), listed, "run", "skip"),
            hook="should_run_mtp",
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
    """The decision fields the policy options set away from their plain values, in the
    options' order: what a traced decision logs beyond who decided."""
    plain = _options.plain().fields()
    return [(n, v) for n, v in decision.options.fields().items() if v != plain[n]]


def _with_options(
    decision: Decision, entry: PolicyEntry | None, model: Any, phase: Any, role: str | None
) -> tuple[Decision, bool]:
    """``decision`` (one that runs MTP) with what each policy option decides, in the options'
    order (``objective`` reads what ``detach`` decided); and whether it may still be cached
    (an answer asked of plugins at every forward may follow the step: it may not). An option
    is asked only where the config names this key or a plugin implements its hook."""
    registry = _registry()
    implements = registry.implements
    given = None if entry is None else entry.options
    options, fresh, ask = decision.options, True, None
    for option in _options.OPTIONS:
        if entry is None and (option.hook is None or not implements(option.hook)):
            continue
        if ask is None:  # made only where an option is asked: a plugin vote decides per forward
            ask = Ask(lambda hook: registry.answers(hook, model, phase), implements, phase, role)
        ask.asked = False
        fields = option.decide(given, options, ask)
        if fields is not None:
            options = options.with_fields(fields, option.name, ask.by if ask.asked else "config")
        fresh = fresh and not ask.asked
    if options is decision.options:
        return decision, fresh
    return replace(decision, options=options), fresh


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
        decision, fresh = _with_options(decision, entry, model, phase, role)
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

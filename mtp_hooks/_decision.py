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
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, Protocol

from . import _option_base, _options, _phase_catalogue, _phases, _roles, _runtime, _sources
from ._errors import MTPHooksError, PolicyConflictError
from ._forward_call import ForwardCall
from ._option_base import Ask, Options
from ._plugin_registry import registry as _registry
from ._policy_entry import PolicyEntry

if TYPE_CHECKING:
    from ._policy_snapshot import PolicySnapshot

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


class Ballot(Protocol):
    """What a decision may ask the plugins (:func:`combine` asks only what it needs)."""

    def votes(self) -> Mapping[str, bool | None]:
        """Each plugin's ``should_run_mtp`` vote by name, sorted by name."""

    def implements(self, hook: str) -> bool:
        """Whether any plugin implements ``hook``."""

    def answers(self, hook: str) -> list[tuple[str, Any]]:
        """Each implementing plugin's raw answer to an option's ``hook``, by name."""


def _by_votes(votes: Mapping[str, bool | None], phase: Any, role: str | None) -> Decision:
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
    decision: Decision, entry: PolicyEntry | None, ballot: Ballot, phase: Any, role: str | None
) -> Decision:
    """``decision`` (one that runs MTP) with what each policy option decides, in the options'
    order (``objective`` reads what ``detach`` decided). An option is asked only where the
    config names this key or a plugin implements its hook."""
    implements = ballot.implements
    given = None if entry is None else entry.options
    options, ask, in_force = decision.options, None, _options.options()
    try:
        for option in in_force:
            if entry is None and (option.hook is None or not implements(option.hook)):
                continue
            if ask is None:  # made only where an option is asked: a plugin vote decides per call
                ask = Ask(ballot.answers, implements, phase, role)
            ask.asked = False
            fields = option.decide(given, options, ask)
            if fields is not None:
                by = ask.by if ask.asked else "config"
                options = options.with_fields(fields, option.name, by)
    except Exception as exc:
        _options.reraise(option, "decide", exc)
    if options is decision.options:
        return decision
    return replace(decision, options=options)


def combine(
    policy: PolicySnapshot, role: str | None, phase: _phases.Phase | str, ballot: Ballot
) -> Decision:
    """The combination rule (the module docstring) for ``role`` in ``phase``: a function of
    the policy snapshot and what ``ballot`` answers alone, as pluggy's ``_multicall`` is of a
    hook's implementations and arguments. The plugins are asked for votes only where the
    config does not decide, and for an option's answers only where MTP runs.

    Raises:
        PolicyError: The policy file is broken, or a plugin's answer is not allowed.
        PolicyConflictError: Plugins disagree and the config does not settle it.
    """
    entry = policy.lookup(role, str(phase))
    if entry is not None and entry.value != "auto":
        decision = Decision(
            run=entry.value == "run", kind="config", phase=phase, role=role, source=entry.source
        )
    else:
        decision = _by_votes(ballot.votes(), phase, role)
    if decision.run:
        decision = _with_options(decision, entry, ballot, phase, role)
    return decision


class _PluginBallot:
    """The registry's answers for one model, phase and forward call, and what asking them
    means for caching: votes kept for the model are handed out again while the registry's
    votes are cacheable, and an option's answer, asked at every forward, is never cached."""

    __slots__ = (
        "model",
        "phase",
        "role",
        "call",
        "trace",
        "reusable",
        "answered",
        "implements",
        "_registry",
    )

    def __init__(
        self, model: Any, phase: Any, role: str | None, call: ForwardCall | None, trace: bool
    ) -> None:
        self.model, self.phase, self.role, self.call, self.trace = model, phase, role, call, trace
        self._registry = _registry()
        self.implements: Callable[[str], bool] = self._registry.implements
        """Whether any plugin implements a hook (the registry's own, asked once per option and
        decision: no call of this object's in between)."""
        self.reusable = False
        """Whether the votes asked may be reused for this model and phase (kept, or kept
        now); a traced decision is logged at every call, so it is never reused."""
        self.answered = False
        """Whether an option's hook was asked."""

    def votes(self) -> Mapping[str, bool | None]:
        self.reusable = not self.trace and self._registry.votes_cacheable()
        key = (self.role, self.phase)
        if self.reusable:
            try:
                kept = _runtime.current.votes_memo.get(self.model)
            except TypeError:  # a model that cannot be held weakly: never kept
                kept = None
            if kept is not None and key in kept:
                return kept[key]
        votes = MappingProxyType(
            dict(sorted(self._registry.votes(self.model, self.phase, self.call)))
        )
        if self.call is not None and self.call.read:  # a vote followed this call's arguments
            self.reusable = False
        if self.reusable:
            try:
                _runtime.current.votes_memo.setdefault(self.model, {})[key] = votes
            except TypeError:
                pass
        return votes

    def answers(self, hook: str) -> list[tuple[str, Any]]:
        self.answered = True
        return self._registry.answers(hook, model=self.model, phase=self.phase)


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

    This is :func:`combine` on the policy in force (:func:`mtp_hooks._sources.refresh`), with
    its caches. A decision may be reused for this model and phase until the snapshot's version
    changes when no plugin was consulted (the config decided, or no plugin implements
    ``should_run_mtp``) or every plugin that votes is a ``cacheable_vote`` and none read the
    forward call, and no plugin was asked an option's answer (a ``mtp_loss_scale``). Cacheable
    votes are kept per model and phase even where such an answer is asked again. Only
    decisions that consulted no plugin are also shared across models of one role (a vote may
    depend on the model).
    """
    policy = _sources.refresh()
    runtime = _runtime.current
    memo = runtime.memo
    if runtime.memo_version != policy.version:
        memo.clear()
        runtime.votes_memo.clear()
        runtime.memo_version = policy.version
    decision = memo.get((role, phase))
    if decision is not None:
        return decision, True
    ballot = _PluginBallot(model, phase, role, call, policy.trace)
    try:
        decision = combine(policy, role, phase, ballot)
    except MTPHooksError as error:  # a plugin's answer, or a refusal: name the phase and role
        error.fill(phase=str(phase), role=role)
        raise
    shared = not decision.votes  # no plugin voted: a pure function of (role, phase)
    cacheable = (shared or ballot.reusable) and not policy.trace and not ballot.answered
    if cacheable and shared:
        memo[(role, phase)] = decision
    if policy.trace:
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

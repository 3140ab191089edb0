"""``explain``: the decision for one model and phase, told as a person would read it.

What :func:`mtp_hooks.decide` decides, and why: the config entry, every plugin's vote, and the
options the decision carries. ``mtp-hooks explain`` prints it.
"""

from __future__ import annotations

from typing import Any

from . import _options, _phase_catalogue, _phases, _roles, _sources
from ._decision import decide
from ._errors import PolicyConflictError
from ._plugin_registry import registry as _registry
from ._policy_errors import did_you_mean


def explain(model: Any, phase: _phases.Phase | str) -> str:
    """Return a human-readable account of :func:`decide` for ``model`` and ``phase``.

    Unlike :func:`decide`, it also lists what the plugins would vote when the config decides,
    and reports a conflict instead of raising it.
    """
    canonical = _phase_catalogue.normalize(phase, "mtp_hooks.explain()")
    role = _roles.role_of(model)
    lines = [f"phase: {canonical}", f"role: {role or '-'}"]
    entry = _sources.lookup(role, str(canonical))
    if entry is not None:
        lines.append(f"config: {entry.value} (from {entry.source})")
    else:
        lines.append("config: not set for this phase")
    roles = _sources.configured_roles()
    if role is not None and roles and role not in roles:  # a typo reads as the default
        lines.append(
            f"note: the policy names no entry for role {role!r}"
            f"{did_you_mean(role, roles)}; it names roles {', '.join(roles)}"
        )
    votes = dict(sorted(_registry().votes(model, canonical)))
    for name, vote in votes.items():
        lines.append(f"plugin {name}: {'abstain' if vote is None else 'run' if vote else 'skip'}")
    if not votes:
        lines.append("plugins: none registered")
    try:
        decision = decide(model, canonical)
    except PolicyConflictError as exc:
        lines.append(f"result: CONFLICT - {exc}")
    else:
        lines.append(
            f"result: {'run' if decision.run else 'skip'} (decided by {decision.decided_by})"
        )
        if decision.run:
            registry = _registry()
            described = _options.each(
                "describe", lambda option: option.describe(decision.options, registry.implementers)
            )
            lines += [line for lines_of_one in described for line in lines_of_one]
    return "\n".join(lines)

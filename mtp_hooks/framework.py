"""Helpers for framework plugins that turn a framework's own config into MTP decisions.

Frameworks hand their config over as plain dicts, OmegaConf nodes or dataclasses. These helpers
read them uniformly and fail with a :class:`mtp_hooks.PolicyError` that names the key, the bad
value and what is expected, before any policy changes. :class:`RoleSettings` keeps what a
plugin was configured with; with it, a plugin's vote can be declared :func:`cacheable_vote`.
"""

from __future__ import annotations

import dataclasses
import numbers
import sys
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from . import _runtime
from ._controller import AcceptanceController
from ._errors import PolicyError
from ._plugin_checks import mark_cacheable
from ._speculation import (
    SpeculationAdvice,
    acceptance_from_counts,
    acceptance_from_megatron,
    recommend_num_speculative_tokens,
)

__all__ = [
    "AcceptanceController",
    "MISSING",
    "RoleSettings",
    "SpeculationAdvice",
    "acceptance_from_counts",
    "acceptance_from_megatron",
    "as_mapping",
    "cacheable_vote",
    "framework_imported",
    "loss_scale_schedule",
    "read_key",
    "recommend_num_speculative_tokens",
    "votes_changed",
]

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

MISSING: Any = object()


def as_mapping(node: Any, where: str) -> Mapping[str, Any]:
    """Return ``node`` (a dict, an OmegaConf ``DictConfig`` or a dataclass) as a mapping.

    Mappings come back as they are, so an OmegaConf node resolves only the keys that are read
    (a framework's custom resolvers need not be registered for the others).

    Example:
        >>> from mtp_hooks.framework import as_mapping
        >>> as_mapping({"enable": True}, "actor_rollout_ref.model.mtp")
        {'enable': True}
    """
    if isinstance(node, Mapping):
        return node
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return dataclasses.asdict(node)
    raise PolicyError(
        f"{where}: expected a mapping (dict or OmegaConf node), got {type(node).__name__}"
    )


def read_key(
    config: Mapping[str, Any],
    key: str,
    types: type | tuple[type, ...],
    where: str,
    default: Any = MISSING,
) -> Any:
    """Read ``config[key]`` and check its type; ``bool`` never passes as ``int``.

    Raises:
        PolicyError: The key is missing (and has no default) or has the wrong type.

    Example:
        >>> from mtp_hooks.framework import read_key
        >>> read_key({"enable": True}, "enable", bool, "mtp")
        True
    """
    if key not in config or config[key] is None and default is not MISSING:
        if default is MISSING:
            raise PolicyError(f"{where}: missing key {key!r}")
        return default
    value = config[key]
    allowed = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool) and bool not in allowed or not isinstance(value, allowed):
        names = " or ".join(t.__name__ for t in allowed)
        raise PolicyError(f"{where}: key {key!r} must be {names}, got {value!r}")
    return value


class RoleSettings(Generic[T]):
    """A framework plugin's configured settings, by model role; ``None`` holds the default.

    Example:
        >>> from mtp_hooks.framework import RoleSettings
        >>> settings = RoleSettings[str]()
        >>> settings.set("everyone")
        >>> settings.set("teachers only", role="teacher")
        >>> settings.get("teacher"), settings.get("student"), settings.get(None)
        ('teachers only', 'everyone', 'everyone')
    """

    def __init__(self) -> None:
        self._by_role: dict[str | None, T] = {}

    def set(self, value: T, role: str | None = None) -> None:
        """Use ``value`` for models of ``role`` (``None``: every role without its own)."""
        self._by_role[role] = value
        _runtime.advance()

    def get(self, role: str | None) -> T | None:
        """The settings for ``role``, else the default, else ``None``."""
        found = self._by_role.get(role) if role is not None else None
        return found if found is not None else self._by_role.get(None)

    def reset(self) -> None:
        """Forget every setting (for tests)."""
        self._by_role.clear()
        _runtime.advance()


def cacheable_vote(hook: F) -> F:
    """Declare a ``should_run_mtp`` implementation whose vote a gate may reuse.

    By default a gate asks every plugin that votes at every forward, since a vote may follow
    state mtp-hooks cannot see, such as the training step. A vote that depends only on the
    model, the phase, the model's role and state whose every change calls
    :func:`votes_changed` (as :meth:`RoleSettings.set` does) can be reused per model and phase
    instead; a decision is then cached only while every plugin that votes is declared so.
    Works on functions and on methods, in either order with ``@hookimpl``.

    Example:
        >>> import mtp_hooks
        >>> from mtp_hooks.framework import cacheable_vote
        >>> @mtp_hooks.hookimpl
        ... @cacheable_vote
        ... def should_run_mtp(model, phase):
        ...     return phase != "eval"
    """
    return mark_cacheable(hook)


def votes_changed() -> None:
    """Tell mtp-hooks that state a :func:`cacheable_vote` depends on has changed: every gate
    asks the plugins again at its next forward."""
    _runtime.advance()


def framework_imported(package: str) -> bool:
    """Whether this process has imported ``package``: the test for a plugin's unconfigured
    defaults.

    A framework's worker processes import the framework before they build a model, and no
    other job does. A plugin that votes without being configured (in a worker, where the
    driver's config is out of reach) therefore votes only where this is true, and abstains
    everywhere else, so that installing it changes no other job. A plugin whose vote is a
    :func:`cacheable_vote` calls :func:`votes_changed` when the framework is imported, if the
    framework offers a hook for that (veRL's ``verl.plugins`` entry points).

    Example:
        >>> from mtp_hooks.framework import framework_imported
        >>> framework_imported("sys"), framework_imported("no_such_framework")
        (True, False)
    """
    return sys.modules.get(package) is not None


def loss_scale_schedule(
    points: Mapping[int, float], step: int, *, interpolate: bool = False
) -> float:
    """The MTP loss weight at ``step``, from ``{first step: weight}`` points.

    Piecewise constant by default: the weight of the last point at or before ``step``, as
    DeepSeek-V3 lowered 0.3 to 0.1 part-way through training. With ``interpolate=True`` the
    weight moves linearly between points (a warm-up or a decay). Before the first point the
    first weight applies, after the last point the last one. Return it from a plugin's
    ``mtp_loss_scale`` hook, with the step the framework gives the plugin.

    Raises:
        PolicyError: No points, a point's step or ``step`` that is not an int >= 0 (a bool, a
            float, a string or ``None`` is refused), or a weight that is not a finite number
            >= 0 (a string is refused).

    Example:
        >>> from mtp_hooks.framework import loss_scale_schedule
        >>> loss_scale_schedule({0: 0.3, 10_000: 0.1}, 9_999)
        0.3
        >>> loss_scale_schedule({0: 0.3, 10_000: 0.1}, 10_000)
        0.1
        >>> loss_scale_schedule({0: 0.0, 1_000: 0.3}, 500, interpolate=True)
        0.15
    """
    from ._weights import check_loss_scale

    if not points:
        raise PolicyError("loss_scale_schedule: give at least one {step: weight} point")
    table = []
    for at, weight in points.items():
        if not _step(at):
            raise PolicyError(f"loss_scale_schedule: step {at!r} is not an int >= 0")
        table.append((int(at), check_loss_scale(weight, f"loss_scale_schedule: step {at}")))
    table.sort()
    if not _step(step):
        raise PolicyError(
            f"loss_scale_schedule: the step {step!r} is not an int >= 0; pass the framework's "
            "training step (an iteration count)"
        )
    step = int(step)
    if step <= table[0][0]:
        return table[0][1]
    for (at, weight), (next_at, next_weight) in zip(table, table[1:], strict=False):
        if at <= step < next_at:
            if not interpolate:
                return weight
            return weight + (next_weight - weight) * (step - at) / (next_at - at)
    return table[-1][1]


def _step(value: object) -> bool:
    """An int >= 0 (numpy's and torch's integer scalars too), never a bool, float or string."""
    return not isinstance(value, bool) and isinstance(value, numbers.Integral) and int(value) >= 0

"""MTP loss-weight schedules, for a plugin's ``mtp_loss_scale`` hook."""

from __future__ import annotations

import numbers
from collections.abc import Mapping

from .._errors import PolicyError
from .._weights import check_loss_scale


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
        PolicyError: ``points`` is not a mapping or is empty, a point's step or ``step`` is
            not an int >= 0 (a bool, a float, a string or ``None`` is refused), or a weight is
            not a finite number >= 0 (a string is refused).

    Example:
        >>> from mtp_hooks.framework import loss_scale_schedule
        >>> loss_scale_schedule({0: 0.3, 10_000: 0.1}, 9_999)
        0.3
        >>> loss_scale_schedule({0: 0.3, 10_000: 0.1}, 10_000)
        0.1
        >>> loss_scale_schedule({0: 0.0, 1_000: 0.3}, 500, interpolate=True)
        0.15
    """
    if not isinstance(points, Mapping):
        raise PolicyError(
            f"loss_scale_schedule: the points are a {{step: weight}} mapping, not "
            f"{type(points).__name__} (e.g. {{0: 0.3, 10_000: 0.1}})"
        )
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

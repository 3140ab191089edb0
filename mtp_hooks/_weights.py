"""What makes an MTP loss weight valid, for the policy config, plugins and schedules alike."""

from __future__ import annotations

from ._errors import PolicyError


def check_loss_scale(raw: object, where: str, value: str = "run") -> float:
    """A finite MTP loss weight >= 0 (``0`` still computes MTP: skip it to save the compute).

    Raises:
        PolicyError: Naming ``where``, for a weight that is negative, NaN, infinite, not a
            number, or given with a value other than ``run``.
    """
    if value != "run":
        raise PolicyError(f"{where}: a loss weight goes with 'run' only, not with {value!r}")
    try:
        scale = float(raw) if not isinstance(raw, bool) else float("nan")  # type: ignore[arg-type]
    except (TypeError, ValueError):
        scale = float("nan")
    if not (scale >= 0 and scale != float("inf")):
        raise PolicyError(
            f"{where}: loss weight {raw!r} is not a finite number >= 0; write e.g. 'run:0.3'. "
            "A weight of 0 still computes MTP: use 'skip' to save the compute."
        )
    return scale

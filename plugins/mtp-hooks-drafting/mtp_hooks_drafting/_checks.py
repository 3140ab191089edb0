"""The checks of the counters and fractions that engines and callers hand in."""

from __future__ import annotations

import math
import numbers
from typing import Any

from mtp_hooks import PolicyError


def count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise PolicyError(f"{what} must be an int >= 0, got {value!r}")
    return int(value)


def fraction(value: Any, what: str) -> float:
    number = not isinstance(value, bool) and isinstance(value, numbers.Real)
    if not (number and math.isfinite(value) and 0.0 <= value <= 1.0):
        raise PolicyError(f"{what} must be a number in [0, 1], got {value!r}")
    return float(value)

"""What makes an MTP loss weight valid, for the policy config, plugins and schedules alike.

A weight is a finite real number >= 0. Numbers are taken as they are (``int`` or ``float``,
never ``bool``, a string or bytes); in a policy string (``run:0.3``) the weight is written in
the grammar of :data:`WEIGHT_GRAMMAR`.
"""

from __future__ import annotations

import math
import numbers
import re
import reprlib

from ._errors import PolicyError

WEIGHT_GRAMMAR = "DIGITS[.DIGITS][e[+|-]DIGITS] or .DIGITS[e[+|-]DIGITS], in ASCII digits"
"""How a weight is written in a policy string: ``0.3``, ``1``, ``.5``, ``3e-1``, ``1e+3``.

No sign, no underscores, no ``inf`` or ``nan``, no digits other than ASCII ``0-9``."""

_WEIGHT = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", re.ASCII)
_HINT = "A weight of 0 still computes MTP: use 'skip' to save the compute."


def check_loss_scale(
    raw: object, where: str, value: str = "run", example: str = "'run:0.3'"
) -> float:
    """A finite MTP loss weight >= 0 given as a number (``0`` still computes MTP: skip it to
    save the compute). ``-0.0`` is returned as ``0.0``. ``example`` is how the error shows a
    good weight written where ``raw`` was (a TOML table writes ``loss_scale = 0.3``).

    Raises:
        PolicyError: Naming ``where``, for a weight that is negative, NaN, infinite, too
            large for a float, not a real number (a string, bytes, a bool), or given with a
            value other than ``run``.
    """
    if value != "run":
        raise PolicyError(f"{where}: a loss weight goes with 'run' only, not with {value!r}")
    number = not isinstance(raw, bool) and isinstance(raw, numbers.Real)
    try:
        scale = float(raw) if number else math.nan  # type: ignore[arg-type]
        kind = "" if number else f" (a {type(raw).__name__} is not read as a number)"
    except OverflowError:  # an int or a Fraction beyond a float's range
        scale, kind = math.inf, " (it overflows a float)"
    if not (math.isfinite(scale) and scale >= 0):
        raise PolicyError(
            f"{where}: loss weight {reprlib.repr(raw)} is not a finite number >= 0{kind}; "
            f"write e.g. {example}. {_HINT}"
        )
    return scale + 0.0  # -0.0 -> 0.0


def parse_loss_scale(text: str, where: str) -> float:
    """The weight written in a policy string after ``run:``, in :data:`WEIGHT_GRAMMAR`.

    Raises:
        PolicyError: Naming ``where``, for text outside the grammar or a weight that overflows.
    """
    if not _WEIGHT.fullmatch(text):
        raise PolicyError(
            f"{where}: loss weight {text!r} is not a finite number >= 0 written as "
            f"{WEIGHT_GRAMMAR}; write e.g. 'run:0.3'. {_HINT}"
        )
    value = float(text)
    if not math.isfinite(value):
        raise PolicyError(
            f"{where}: loss weight {text!r} is not a finite number >= 0 (it overflows a float); "
            "write e.g. 'run:0.3'"
        )
    return check_loss_scale(value, where)

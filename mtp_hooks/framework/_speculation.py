"""Speculative decoding in a rollout engine: its acceptance as :class:`MTPMetrics`, and its depth.

A rollout engine that drafts with the model's MTP layers counts, per draft position, how many
drafts it proposed and how many it accepted. :func:`acceptance_from_counts` and
:func:`acceptance_from_megatron` turn those counters into the :class:`mtp_hooks.MTPMetrics` that
:class:`mtp_hooks.framework.AcceptanceController` consumes, so the controller can follow the
engine's own acceptance instead of (or beside) teacher-forced figures.
:func:`recommend_num_speculative_tokens` picks how many tokens to draft from that acceptance and
the measured cost of an engine step, so a stale drafter stops slowing the rollouts down.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import PolicyError
from .._metrics import MTPMetrics
from ._acceptance_controller import _reduce

__all__ = [
    "SpeculationAdvice",
    "acceptance_from_counts",
    "acceptance_from_megatron",
    "recommend_num_speculative_tokens",
]


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise PolicyError(f"{what} must be an int >= 0, got {value!r}")
    return int(value)


def _fraction(value: Any, what: str) -> float:
    number = not isinstance(value, bool) and isinstance(value, numbers.Real)
    if not (number and math.isfinite(value) and 0.0 <= value <= 1.0):
        raise PolicyError(f"{what} must be a number in [0, 1], got {value!r}")
    return float(value)


def acceptance_from_counts(
    drafts: int | Sequence[int], accepted_per_position: Sequence[int]
) -> MTPMetrics:
    """The acceptance of a rollout engine's drafts, from its counters, as :class:`MTPMetrics`.

    Engines count acceptance *chained*: a draft at position ``k`` counts as accepted only when
    the drafts at positions ``1..k`` were all accepted (greedy or rejection-sampling
    verification stops at the first miss). megatron-core's ``DynamicInferenceEngine``, vLLM
    (``spec_decode_num_drafts`` and ``spec_decode_num_accepted_tokens_per_pos``) and SGLang
    count this way.

    Args:
        drafts: How many times a draft was proposed at each position: one int for all
            positions (the number of verify steps that drafted, per request), or one per
            position.
        accepted_per_position: Per position ``k`` (index 0 is the first draft), how many of
            those drafts were accepted together with every draft before them.

    Returns:
        ``chain_acceptance[k]`` is ``accepted[k] / drafts[k]``; ``accepted_length`` their sum
        (the mean number of drafted tokens a verify step accepts); ``acceptance[k]`` the
        fraction of drafts at position ``k`` that were right among those checked (the earlier
        ones accepted); ``tokens`` the drafts per position. An engine has no loss, so ``loss``
        is empty, and ``forwards`` is 0.

    Raises:
        PolicyError: A count is not an int >= 0, more drafts are accepted than proposed, or a
            later position accepts more than an earlier one (not chained counts).

    Example:
        >>> from mtp_hooks.framework import acceptance_from_counts
        >>> m = acceptance_from_counts(200, [150, 90])
        >>> m.chain_acceptance, m.accepted_length, m.acceptance
        ((0.75, 0.45), 1.2, (0.75, 0.6))
    """
    accepted = [
        _count(a, f"acceptance_from_counts: accepted_per_position[{k}]")
        for k, a in enumerate(accepted_per_position)
    ]
    if isinstance(drafts, Sequence):
        proposed = [_count(d, f"acceptance_from_counts: drafts[{k}]") for k, d in enumerate(drafts)]
        if len(proposed) != len(accepted):
            raise PolicyError(
                f"acceptance_from_counts: {len(proposed)} draft counts for "
                f"{len(accepted)} positions; give one per position, or one int for all"
            )
    else:
        proposed = [_count(drafts, "acceptance_from_counts: drafts")] * len(accepted)
    for k, (a, d) in enumerate(zip(accepted, proposed, strict=True)):
        if a > d:
            raise PolicyError(
                f"acceptance_from_counts: position {k + 1} accepted {a} of {d} drafts"
            )
        if k and a > accepted[k - 1]:
            raise PolicyError(
                f"acceptance_from_counts: position {k + 1} accepted {a}, more than position "
                f"{k} ({accepted[k - 1]}); give chained counts (a draft counts only when the "
                "drafts before it were accepted too)"
            )
    chain = tuple(a / d if d else 0.0 for a, d in zip(accepted, proposed, strict=True))
    checked = [proposed[0] if proposed else 0, *accepted[:-1]]
    acceptance = tuple(a / c if c else 0.0 for a, c in zip(accepted, checked, strict=True))
    return MTPMetrics(
        loss=(),
        acceptance=acceptance,
        tokens=tuple(proposed),
        forwards=0,
        chain_acceptance=chain,
        accepted_length=sum(chain),
    )


def acceptance_from_megatron(metrics: Mapping[str, Any]) -> MTPMetrics:
    """:func:`acceptance_from_counts` from the metrics dict of megatron's inference engine.

    ``DynamicInferenceEngine`` reports ``spec_decode_acceptance_rate_pos{N}`` (percent, chained,
    ``N`` from 1), ``spec_decode_tokens_proposed`` (summed over positions) and
    ``spec_decode_tokens_accepted``, each under an ``inference/`` prefix in its logged dict;
    both spellings are read. The drafts per position are the proposed total over the number
    of positions (exact unless stop words cut drafts short).

    Raises:
        PolicyError: A key is missing, a rate is outside [0, 100], or the rates do not fall
            with the position.

    Example:
        >>> from mtp_hooks.framework import acceptance_from_megatron
        >>> m = acceptance_from_megatron({
        ...     "inference/spec_decode_acceptance_rate_pos1": 75.0,
        ...     "inference/spec_decode_acceptance_rate_pos2": 45.0,
        ...     "inference/spec_decode_tokens_proposed": 400,
        ...     "inference/spec_decode_tokens_accepted": 240})
        >>> m.chain_acceptance, m.tokens
        ((0.75, 0.45), (200, 200))
    """

    def get(key: str) -> Any:
        for name in (f"inference/{key}", key):
            if name in metrics:
                return metrics[name]
        raise PolicyError(
            f"acceptance_from_megatron: no {key!r} in the engine's metrics; pass the dict of a "
            "DynamicInferenceEngine built with num_speculative_tokens > 0, after it drafted"
        )

    rates: list[float] = []
    while any(
        f"{p}spec_decode_acceptance_rate_pos{len(rates) + 1}" in metrics for p in ("inference/", "")
    ):
        rate = get(f"spec_decode_acceptance_rate_pos{len(rates) + 1}")
        if isinstance(rate, bool) or not isinstance(rate, numbers.Real):
            raise PolicyError(f"acceptance_from_megatron: rate pos{len(rates) + 1} is {rate!r}")
        rates.append(_fraction(rate / 100.0, f"acceptance_from_megatron: pos{len(rates) + 1}"))
    if not rates:
        get("spec_decode_acceptance_rate_pos1")  # raises, naming the key
    total = _count(get("spec_decode_tokens_proposed"), "spec_decode_tokens_proposed")
    drafts = total // len(rates)
    return acceptance_from_counts(drafts, [round(rate * drafts) for rate in rates])


@dataclass(frozen=True)
class SpeculationAdvice:
    """What :func:`recommend_num_speculative_tokens` recommends, and why.

    Attributes:
        num_speculative_tokens: The number of tokens to draft per step (0: do not speculate).
        speedups: Per ``k`` (index ``k``, from 0), the expected output tokens/s of drafting
            ``k`` tokens, relative to not speculating; index 0 is 1.0.
        chain_acceptance: The chained acceptance it was computed from (after the reduction
            across ranks).
        step_cost: The step cost per ``k`` it was computed from, relative to a step that
            drafts nothing.
    """

    num_speculative_tokens: int
    speedups: tuple[float, ...]
    chain_acceptance: tuple[float, ...]
    step_cost: tuple[float, ...]


def recommend_num_speculative_tokens(
    acceptance: MTPMetrics | Sequence[float],
    *,
    step_cost: float | Sequence[float],
    max_tokens: int | None = None,
    min_speedup: float = 1.0,
    group: Any = None,
) -> SpeculationAdvice:
    """How many tokens to draft per engine step: the ``k`` with the highest expected tokens/s.

    A verify step that drafted ``k`` tokens yields ``1 + sum(chain_acceptance[:k])`` tokens
    and takes ``step_cost[k]`` (relative to ``step_cost[0]``), so drafting ``k`` tokens is
    expected to give ``(1 + sum(chain_acceptance[:k])) * step_cost[0] / step_cost[k]`` times
    the tokens/s of not speculating. The highest wins; a tie goes to the smaller ``k``, and a
    ``k > 0`` must beat ``min_speedup`` or the answer is 0. A stale or undertrained drafter
    thus turns speculation off instead of slowing the rollouts down.

    Deterministic: the same figures give the same answer. Under ``torch.distributed`` the
    figures are averaged over ``group`` first (a collective: call it on every rank), so every
    rank drafts the same number of tokens.

    Args:
        acceptance: Chained acceptance per draft position (:class:`MTPMetrics`, whose
            ``chain_acceptance`` is read, from a recorded forward or from
            :func:`acceptance_from_counts`; or the fractions themselves).
        step_cost: The measured time of one engine step that drafts ``k`` tokens, for
            ``k = 0, 1, ...`` (any unit; the first is the reference), or one number: the cost
            each drafted token adds to a step, relative to a step that drafts none
            (``step_cost[k] = 1 + k * c``).
        max_tokens: The most tokens the engine may draft (its MTP depth); defaults to the
            depth the figures cover.
        min_speedup: The expected speed-up a ``k > 0`` must exceed (default 1.0: any gain).
        group: The process group to average over; ``None``: megatron's data-parallel group
            where megatron is initialized, else the default group.

    Raises:
        PolicyError: A figure is out of range or not finite, or no step cost is given for the
            depths asked about.

    Example:
        >>> from mtp_hooks.framework import recommend_num_speculative_tokens
        >>> recommend_num_speculative_tokens([0.8, 0.6], step_cost=0.15).num_speculative_tokens
        2
        >>> recommend_num_speculative_tokens([0.05, 0.0], step_cost=0.15).num_speculative_tokens
        0
    """
    chain_in = acceptance.chain_acceptance if isinstance(acceptance, MTPMetrics) else acceptance
    where = "recommend_num_speculative_tokens"
    if isinstance(chain_in, (str, bytes)) or not isinstance(chain_in, Sequence):
        raise PolicyError(f"{where}: acceptance must be MTPMetrics or a sequence of fractions")
    chain = [_fraction(a, f"{where}: acceptance[{k}]") for k, a in enumerate(chain_in)]
    depth = len(chain) if max_tokens is None else _count(max_tokens, f"{where}: max_tokens")
    depth = min(depth, len(chain))
    if isinstance(step_cost, Sequence) and not isinstance(step_cost, (str, bytes)):
        costs = [_positive(c, f"{where}: step_cost[{k}]") for k, c in enumerate(step_cost)]
        if len(costs) < depth + 1:
            raise PolicyError(
                f"{where}: {len(costs)} step costs for depths 0..{depth}; measure a step for "
                f"every k up to {depth}, or pass max_tokens={max(len(costs) - 1, 0)}"
            )
        costs = costs[: depth + 1]
    else:
        per_token: Any = step_cost  # checked at run time: callers pass anything
        if isinstance(per_token, bool) or not isinstance(per_token, numbers.Real):
            raise PolicyError(f"{where}: step_cost must be a number or a sequence of numbers")
        if not (math.isfinite(per_token) and per_token >= 0):
            raise PolicyError(f"{where}: step_cost must be finite and >= 0, got {per_token!r}")
        costs = [1.0 + k * float(per_token) for k in range(depth + 1)]
    floor: Any = min_speedup
    if isinstance(floor, bool) or not isinstance(floor, numbers.Real) or not math.isfinite(floor):
        raise PolicyError(f"{where}: min_speedup must be a finite number, got {floor!r}")
    # Every rank decides from the same figures: the mean over the group.
    reduced = _reduce((*chain[:depth], *costs, 1.0), group)
    ranks = reduced[-1]
    chain = [c / ranks for c in reduced[:depth]]
    costs = [c / ranks for c in reduced[depth:-1]]
    speedups = tuple((1.0 + sum(chain[:k])) * costs[0] / costs[k] for k in range(depth + 1))
    best = 0
    for k in range(1, depth + 1):
        if speedups[k] > speedups[best] and speedups[k] > min_speedup:
            best = k
    return SpeculationAdvice(
        num_speculative_tokens=best,
        speedups=speedups,
        chain_acceptance=tuple(chain),
        step_cost=tuple(c / costs[0] for c in costs),
    )


def _positive(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise PolicyError(f"{what} must be a number > 0, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise PolicyError(f"{what} must be finite and > 0, got {value!r}")
    return float(value)

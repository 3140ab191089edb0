"""How many tokens a rollout engine should draft: the depth with the best expected tokens/s.

:func:`recommend_num_speculative_tokens` picks it from the engine's acceptance (as
:func:`~mtp_hooks_drafting.acceptance_from_counts` gives it, or teacher-forced figures) and the
measured cost of an engine step, so a stale drafter stops slowing the rollouts down.
"""

from __future__ import annotations

import math
import numbers
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mtp_hooks import MTPMetrics, PolicyError

from ._checks import count, fraction
from ._ranks import sum_over_ranks

__all__ = ["SpeculationAdvice", "recommend_num_speculative_tokens"]


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
        >>> from mtp_hooks_drafting import recommend_num_speculative_tokens
        >>> recommend_num_speculative_tokens([0.8, 0.6], step_cost=0.15).num_speculative_tokens
        2
        >>> recommend_num_speculative_tokens([0.05, 0.0], step_cost=0.15).num_speculative_tokens
        0
    """
    chain_in = acceptance.chain_acceptance if isinstance(acceptance, MTPMetrics) else acceptance
    where = "recommend_num_speculative_tokens"
    if isinstance(chain_in, (str, bytes)) or not isinstance(chain_in, Sequence):
        raise PolicyError(f"{where}: acceptance must be MTPMetrics or a sequence of fractions")
    chain = [fraction(a, f"{where}: acceptance[{k}]") for k, a in enumerate(chain_in)]
    depth = len(chain) if max_tokens is None else count(max_tokens, f"{where}: max_tokens")
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
    reduced = sum_over_ranks((*chain[:depth], *costs, 1.0), group)
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


class ChainWindow:
    """The chained acceptance per draft position of the figures of the last ``window`` updates,
    weighted by positions: what :meth:`AcceptanceController.advise` drafts by. This rank's
    figures only; :func:`recommend_num_speculative_tokens` averages over the ranks."""

    def __init__(self, window: int) -> None:
        # per update: the chained acceptance summed over positions, and the positions
        self.updates: deque[tuple[list[float], list[float]]] = deque(maxlen=window)

    def add(self, figures: Sequence[MTPMetrics]) -> None:
        """One update's figures (those that are not finite left out); none: nothing changes."""
        depth = max((len(m.chain_acceptance) for m in figures), default=0)
        sums, positions = [0.0] * depth, [0.0] * depth
        for m in figures:
            for k, (rate, drafted) in enumerate(zip(m.chain_acceptance, m.tokens, strict=False)):
                if math.isfinite(rate) and drafted > 0:
                    sums[k] += rate * drafted
                    positions[k] += drafted
        if any(positions):
            self.updates.append((sums, positions))

    def pooled(self) -> list[float]:
        """The pooled chained acceptance, up to the first position no update covered; empty
        before any figures."""
        depth = max((len(positions) for _, positions in self.updates), default=0)
        sums, positions = [0.0] * depth, [0.0] * depth
        for update_sums, update_positions in self.updates:
            for k, (total, drafted) in enumerate(zip(update_sums, update_positions, strict=True)):
                sums[k] += total
                positions[k] += drafted
        covered = next((k for k, drafted in enumerate(positions) if drafted == 0), depth)
        return [sums[k] / positions[k] for k in range(covered)]

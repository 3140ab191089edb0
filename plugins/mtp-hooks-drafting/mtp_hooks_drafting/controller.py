"""A closed loop that keeps the MTP drafter fresh: the training MTP weight set from its acceptance.

:class:`AcceptanceController` is a plugin object, exported as
``mtp_hooks_drafting.AcceptanceController``. It collects the :class:`mtp_hooks.MTPMetrics` of
recorded forwards (``eval=run+metrics``), and at :meth:`~AcceptanceController.update`, which
every rank calls at the same point of the loop, it pools the last ``window`` updates' figures
(weighted by positions, reduced across the data-parallel ranks) and picks the training-phase
action: one MTP loss weight while the drafter is below the target, another weight, or a skip,
once it is at or above it. It also reports a drafter that died (:class:`DeadDrafterWarning`),
and advises how many tokens to draft from the same figures
(:meth:`~AcceptanceController.advise`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mtp_hooks import MTPMetrics, PhaseLike, PolicyError
from mtp_hooks.framework import cacheable_vote, check_phase, votes_changed
from mtp_hooks.plugins import hookimpl

from ._death import DeathWatch
from ._ranks import sum_over_ranks
from .draft_depth import ChainWindow, SpeculationAdvice, recommend_num_speculative_tokens

if TYPE_CHECKING:
    import torch

METRICS = (
    "accepted_length",
    "acceptance",
    "chain_acceptance",
    "sampled_accepted_length",
    "single_position_accepted_length",
    "single_position_sampled_accepted_length",
)
_SINGLE_POSITION_MISSING = (
    "an engine's counters carry none, and +metrics computes it only where megatron-core has "
    "compute_mtp_single_step (0.17 on), without sequence or context parallelism, FP8, MoE or "
    "CUDA graphs); record with +metrics there"
)
# The whole-sequence figures that only some MTPMetrics carry, and how to get them
_OPTIONAL = {
    "sampled_accepted_length": (
        "an engine's counters, from acceptance_from_counts or acceptance_from_megatron, carry "
        "none); record with +metrics"
    ),
    "single_position_accepted_length": _SINGLE_POSITION_MISSING,
    "single_position_sampled_accepted_length": _SINGLE_POSITION_MISSING,
}
MAX_WINDOW = 1_000_000  # updates pooled at most: far beyond any run's, and a deque can hold it


def _weight(value: float | None, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise PolicyError(f"AcceptanceController: {name} must be a weight >= 0 or None (skip)")
    if not math.isfinite(value):
        raise PolicyError(f"AcceptanceController: {name} must be finite, got {value!r}")
    return float(value)


class AcceptanceController:
    """Sets the MTP loss weight of ``phase`` from the drafter's recent acceptance.

    Args:
        target: The value of ``metric`` the drafter should reach.
        below: The MTP loss weight while the pooled metric is below ``target``.
        above: The weight once it is at or above ``target``; ``None`` skips MTP then.
        metric: ``"accepted_length"`` (greedy drafts accepted per verify step, the default),
            ``"acceptance"`` or ``"chain_acceptance"`` (at ``depth``), or
            ``"sampled_accepted_length"`` (drafts a sampling engine expects to accept, from
            ``+metrics`` alone: no rollout needed; an engine's counters do not carry it), or
            ``"single_position_accepted_length"`` and
            ``"single_position_sampled_accepted_length"`` (the same two over drafts computed
            as megatron-core's engine computes them; see :class:`~mtp_hooks.MTPMetrics`).
        depth: The MTP depth that ``acceptance``/``chain_acceptance`` read (1 = first).
        window: How many :meth:`update` calls' figures are pooled for a decision (1 to
            1,000,000).
        watch: The phase whose recorded metrics are collected (``"eval"``).
        phase: The phase whose MTP weight is controlled (``"train"``).
        dead_below: The figure below which a drafter is reported dead
            (:class:`DeadDrafterWarning`), from the figures of an update after a weight sync
            alone (``update(synced=True)``), once a decision has seen the pooled figure at or
            above both ``target`` and ``dead_below``; ``None`` turns the report off. Default
            ``0.05``: near zero for every metric, since each is a fraction or a count of
            accepted drafts.
        group: The process group the figures are reduced over; ``None``: megatron's data-parallel
            group where megatron is initialized, else the default group. Without
            ``torch.distributed`` nothing is reduced.

    Before the first :meth:`update` that has figures, the ``below`` weight applies (train
    the drafter until it is known to be good). The decision is deterministic and changes only
    at :meth:`update`, never inside a step.

    The window counts updates that carried figures: an update with none (no recorded forward,
    figures over no positions, or only figures that are not finite, which are ignored) adds
    nothing to the window and leaves the decision as it was.

    Example:
        >>> import mtp_hooks
        >>> from mtp_hooks_drafting import AcceptanceController
        >>> controller = AcceptanceController(target=1.5, below=0.3, above=0.1)
        >>> mtp_hooks.plugins.register(controller, name="drafter")
        'drafter'
        >>> metrics = mtp_hooks.MTPMetrics(loss=(2.0, 2.5), acceptance=(0.7, 0.5),
        ...     tokens=(100, 99), forwards=1, chain_acceptance=(0.7, 0.4), accepted_length=1.1)
        >>> controller.update(metrics)
        0.3
        >>> mtp_hooks.decide(None, "train").options.loss_scale
        0.3
    """

    def __init__(
        self,
        *,
        target: float,
        below: float | None,
        above: float | None,
        metric: str = "accepted_length",
        depth: int = 1,
        window: int = 1,
        watch: PhaseLike = "eval",
        phase: PhaseLike = "train",
        group: Any = None,
        dead_below: float | None = 0.05,
    ) -> None:
        if metric not in METRICS:
            raise PolicyError(f"AcceptanceController: metric must be one of {METRICS}")
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise PolicyError("AcceptanceController: depth must be an int >= 1")
        if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= MAX_WINDOW:
            raise PolicyError(
                f"AcceptanceController: window must be an int from 1 to {MAX_WINDOW}, got "
                f"{window!r}"
            )
        if isinstance(target, bool) or not isinstance(target, (int, float)):
            raise PolicyError("AcceptanceController: target must be a number")
        if not math.isfinite(target):
            raise PolicyError(
                f"AcceptanceController: target must be finite, got {target!r}; the drafter "
                "would never reach a NaN target, and always or never an infinite one"
            )
        self.target, self.metric, self.depth = float(target), metric, depth
        self.death = DeathWatch(dead_below)
        self.below, self.above = _weight(below, "below"), _weight(above, "above")
        self.watch = str(check_phase(watch, "AcceptanceController watch"))
        self.phase = str(check_phase(phase, "AcceptanceController phase"))
        self.group = group
        self.pending: list[MTPMetrics] = []  # collected since the last update
        self.history: deque[tuple[float, float]] = deque(maxlen=window)  # (sum, weight)
        self.value: float | None = None  # the pooled metric of the last decision
        self.weight: float | None = self.below  # what the controlled phase runs with
        self.chains = ChainWindow(window)  # the chained acceptance, for advise()

    @property
    def dead(self) -> bool:
        """Whether the last update's figures found a drafter that had died
        (:class:`DeadDrafterWarning`)."""
        return self.death.dead

    # -- feeding and deciding -------------------------------------------------------------
    def collect(self, metrics: MTPMetrics) -> None:
        """Keep ``metrics`` for the next :meth:`update` (this rank only; no communication)."""
        self.pending.append(metrics)

    def update(self, *metrics: MTPMetrics, synced: bool = False) -> float | None:
        """Pool what was collected (and ``metrics``), reduce it across ranks, and decide.

        A collective under ``torch.distributed``: call it on every rank of the group at the
        same point of the loop (after evaluation, at a log interval). Returns the weight the
        controlled phase now runs with; ``None`` means skip.

        Args:
            metrics: Figures beside those collected from recorded forwards (an engine's
                counters, :func:`~mtp_hooks_drafting.acceptance_from_counts`).
            synced: Whether the figures come from rollouts after a weight sync (the engine
                drafted with weights it had just received). A drafter that accepts almost
                nothing then is reported dead (``dead_below``); a sudden fall without a sync
                is the data moving, which the controller answers by training the drafter.

        Raises:
            PolicyError: Something other than :class:`~mtp_hooks.MTPMetrics` is given (the
                collective is never entered, so every rank raises alike).
        """
        for m in metrics:
            if not isinstance(m, MTPMetrics):
                raise PolicyError(
                    f"AcceptanceController.update: got {type(m).__name__}; give MTPMetrics "
                    "(from handle.metrics(), a recorded forward, or acceptance_from_counts)"
                )
        batch, self.pending = [*self.pending, *metrics], []
        whole = self.metric == "accepted_length" or self.metric in _OPTIONAL
        usable = [m for m in batch if whole or len(m.tokens) >= self.depth]
        unsampled = self.metric in _OPTIONAL and any(
            m.tokens and getattr(m, self.metric) is None for m in usable
        )
        # A figure that is not finite (a NaN from an empty or broken forward) is ignored: it
        # never enters the window and never counts as reaching the target.
        pooled_each = [
            (v, w) for v, w in map(self._pooled, usable) if math.isfinite(v) and math.isfinite(w)
        ]
        pooled_each = [] if unsampled else pooled_each
        total = (
            sum(v for v, _ in pooled_each),
            sum(w for _, w in pooled_each),
            float(len(batch) - len(usable)),  # figures of a model shallower than ``depth``
            float(unsampled),  # figures without the watched one (an engine's counts)
        )
        value_sum, weight, shallow, unsampled_ranks = sum_over_ranks(total, self.group)
        if unsampled_ranks:  # on every rank alike: the count went through the collective
            raise PolicyError(
                f"AcceptanceController: {self.metric} was asked for, but figures without it "
                f"were given ({_OPTIONAL[self.metric]}, or watch accepted_length"
            )
        if shallow:  # on every rank alike: the count went through the collective
            raise PolicyError(
                f"AcceptanceController: {self.metric} at depth {self.depth} was asked for, but "
                f"{int(shallow)} recorded figure(s) come from a model with fewer MTP depths; "
                "give a depth the model has"
            )
        if weight > 0:
            self.history.append((value_sum, weight))
            self.death.check(value_sum / weight, synced, self.target, self.metric)
        self.chains.add(usable)
        pooled = sum(w for _, w in self.history)
        if pooled > 0:
            self.value = sum(v for v, _ in self.history) / pooled
            self.death.saw(self.value, self.target)
            chosen = self.below if self.value < self.target else self.above
            if chosen != self.weight:
                self.weight = chosen
                votes_changed()  # gates ask again at their next forward
        return self.weight

    def advise(
        self,
        *,
        step_cost: float | Sequence[float],
        max_tokens: int | None = None,
        min_speedup: float = 1.0,
    ) -> SpeculationAdvice:
        """How many tokens a rollout engine should draft, from the chained acceptance of the
        figures of the last ``window`` updates (this rank's, averaged over the controller's
        group): :func:`~mtp_hooks_drafting.recommend_num_speculative_tokens` on them.

        A collective under ``torch.distributed``, like :meth:`update`; every rank's figures
        must cover the same number of draft positions.

        Raises:
            PolicyError: No update has carried figures yet, or a figure or cost is out of
                range (as :func:`~mtp_hooks_drafting.recommend_num_speculative_tokens` says).

        Example:
            >>> from mtp_hooks_drafting import AcceptanceController, acceptance_from_counts
            >>> controller = AcceptanceController(target=1.5, below=0.3, above=None)
            >>> controller.update(acceptance_from_counts(100, [90, 80]))  # 1.7 accepted: skip
            >>> controller.advise(step_cost=0.2).num_speculative_tokens
            2
        """
        pooled = self.chains.pooled()
        if not pooled:
            raise PolicyError(
                "AcceptanceController.advise: no update has carried figures yet; call "
                "update() with the engine's counters (acceptance_from_counts) or recorded "
                "MTPMetrics first"
            )
        return recommend_num_speculative_tokens(
            pooled,
            step_cost=step_cost,
            max_tokens=max_tokens,
            min_speedup=min_speedup,
            group=self.group,
        )

    def _pooled(self, m: MTPMetrics) -> tuple[float, float]:
        """``(metric * positions, positions)`` of one :class:`MTPMetrics`."""
        if not m.tokens:
            return (0.0, 0.0)
        if self.metric == "accepted_length":
            return (m.accepted_length * m.tokens[0], float(m.tokens[0]))
        if self.metric in _OPTIONAL:
            return ((getattr(m, self.metric) or 0.0) * m.tokens[0], float(m.tokens[0]))
        index = self.depth - 1
        values = m.acceptance if self.metric == "acceptance" else m.chain_acceptance
        return (values[index] * m.tokens[index], float(m.tokens[index]))

    # -- the plugin's hooks ---------------------------------------------------------------------
    @hookimpl
    def mtp_metrics(self, model: torch.nn.Module, phase: PhaseLike, metrics: MTPMetrics) -> None:
        """Collects the watched phase's figures."""
        if str(phase) == self.watch:
            self.collect(metrics)

    @hookimpl
    @cacheable_vote  # the vote changes only at update(), which tells the gates
    def should_run_mtp(self, model: torch.nn.Module | None, phase: PhaseLike) -> bool | None:
        """Skips the controlled phase while the decision is a skip; abstains otherwise."""
        return False if str(phase) == self.phase and self.weight is None else None

    @hookimpl
    def mtp_loss_scale(self, model: torch.nn.Module | None, phase: PhaseLike) -> float | None:
        """The controlled phase's weight."""
        return self.weight if str(phase) == self.phase else None

    def __repr__(self) -> str:
        action = "skip" if self.weight is None else f"run:{self.weight:g}"
        dead = ", the drafter dead" if self.death.dead else ""
        return (
            f"AcceptanceController({self.metric} target {self.target:g}: now {action}, "
            f"pooled {self.value}{dead})"
        )

"""A drafter that died: near-zero acceptance right after a weight sync, where it had been good."""

from __future__ import annotations

import math
import warnings

from mtp_hooks import PolicyError


class DeadDrafterWarning(UserWarning):
    """A drafter that had reached its target accepts almost nothing right after a weight sync.

    That is the mark of MTP weights that the sync left behind (the rollout engine drafts with
    the MTP layers it had, or with none), where a drafter that goes stale fades over many
    steps. Issued once when the drafter dies, on every rank alike; the controller's
    :attr:`AcceptanceController.dead` says whether it is dead now.
    """


class DeathWatch:
    """An :class:`AcceptanceController`'s watch for a drafter that died, from its figures. The
    controller's target and metric are passed at each call, so a controller whose target is
    changed is watched against the new one.

    Args:
        below: The figure below which a drafter is dead (``dead_below``), or ``None``: never.
    """

    def __init__(self, below: float | None) -> None:
        if below is not None and not (
            not isinstance(below, bool)
            and isinstance(below, (int, float))
            and math.isfinite(below)
            and below >= 0
        ):
            raise PolicyError(
                "AcceptanceController: dead_below must be a finite number >= 0, or None (no "
                f"report), got {below!r}"
            )
        self.below = None if below is None else float(below)
        self.reached = False  # whether a decision has seen the drafter at its target, alive
        self.dead = False

    def saw(self, pooled: float, target: float) -> None:
        """A decision's pooled figure: the drafter reached ``target`` (a drafter that never
        did is untrained, not dead), and was alive then."""
        alive = self.below is None or pooled >= self.below
        self.reached = self.reached or (pooled >= target and alive)

    def check(self, latest: float, synced: bool, target: float, metric: str) -> None:
        """One update's figure of ``metric`` (the same on every rank): dead where it had
        reached its target and accepts almost nothing right after a weight sync, until it
        accepts again."""
        was, low = self.dead, self.below is not None and latest < self.below
        self.dead = low and (was or (synced and self.reached))
        if self.dead and not was:
            warnings.warn(
                DeadDrafterWarning(
                    f"AcceptanceController: the drafter's {metric} is {latest:.3g} right "
                    f"after a weight sync, below dead_below={self.below:g}, where it had "
                    f"reached the target {target:g}: check that the sync carries the MTP "
                    "layers' weights (the model's mtp.* parameters) to the rollout engine with "
                    "the trunk's"
                ),
                stacklevel=3,  # the caller of AcceptanceController.update
            )

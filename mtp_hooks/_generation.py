"""One counter that advances whenever anything a decision depends on changes.

The policy sources, the registered plugins, the declared phases and the models' roles each
advance it when they change, so a gate may reuse a decision as long as the counter stands still.
"""

from __future__ import annotations

counter = [0]  # read directly on the hot path; change it only through advance()


def advance() -> None:
    """Invalidate every cached decision."""
    counter[0] += 1

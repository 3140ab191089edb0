"""Print how long each nox session of a run took, against the budget of the whole run.

``scripts/nox`` calls this after every run with nox's JSON report (``--report``) and the run's
wall time. A run of the default sessions (what CI runs) has a budget of 30 minutes on a 2-core
machine with nothing beside it (docs/contributing.md, "The time budget"); a run over it is
named on the last line, with where to look. It never fails the run: wall time depends on the
machine, and a timing is a measurement, not a test.
"""

from __future__ import annotations

import json
import sys

BUDGET_S = 30 * 60


def main(report: str, wall_s: int) -> None:
    try:
        with open(report) as f:
            sessions = json.load(f)["sessions"]
    except (OSError, ValueError, KeyError):
        return  # nox wrote no report (nox -l, a usage error): nothing ran
    ran = [s for s in sessions if s.get("result") != "skipped"]
    if not ran:
        return
    names = [(s.get("signatures") or [s["name"]])[0] for s in sessions]  # tests(mcore019)
    width = max(len(name) for name in names + ["all sessions"])
    print("\nsession times:", file=sys.stderr)
    for name, s in zip(names, sessions, strict=True):
        print(f"  {name:<{width}}  {s['duration']:7.0f} s  {s['result']}", file=sys.stderr)
    total = sum(s["duration"] for s in sessions)
    print(f"  {'all sessions':<{width}}  {total:7.0f} s  ({wall_s} s wall, with installs)",
          file=sys.stderr)  # fmt: skip
    if wall_s > BUDGET_S:
        print(
            f"over the budget: {wall_s / 60:.0f} min against {BUDGET_S // 60} min for the whole "
            "run on 2 cores; each test session lists its slowest tests above "
            "(docs/contributing.md, 'The time budget', says what runs where and why)",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))

"""The table of docs/benchmarks.md's veRL section, from record.sh's JSONs.

    python benchmarks/verl_worker/summarize.py DIR [--warmup 3]

For each veRL MTP config, the runs with and without mtp-hooks-verl side by side: MTP forwards
per call, the median seconds of ``compute_log_prob`` and ``update_actor`` over the steps after
the warm-up (with their min-max spread), the ratio of the medians, and the peak GiB allocated.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def load(directory: Path, mtp: str, plugin: str) -> dict | None:
    path = directory / f"large_{mtp}_{plugin}.json"
    if not path.exists() or not path.read_text().strip():
        return None
    return json.loads(path.read_text().strip().splitlines()[-1])


def timing(run: dict, call: str, warmup: int) -> tuple[float, float, float]:
    seconds = [step["seconds"][call] for step in run["steps"][warmup:]]
    return statistics.median(seconds), min(seconds), max(seconds)


def row(run: dict, call: str, warmup: int) -> str:
    median, low, high = timing(run, call, warmup)
    return f"{median:.3f} s ({low:.3f}-{high:.3f})"


def table(directory: Path, warmup: int) -> str:
    lines = [
        "| veRL config | mtp-hooks-verl | MTP forwards (log-prob / update) | compute_log_prob "
        "| update_actor | peak GiB (log-prob / update) |",
        "|---|---|---|---|---|---|",
    ]
    ratios = []
    for mtp, label in (("off", "`enable=False`"), ("load", "`enable=True`, no `enable_train`")):
        runs = {plugin: load(directory, mtp, plugin) for plugin in ("without", "with")}
        for plugin, run in runs.items():
            if run is None:
                lines.append(f"| {label} | {plugin} | (no run) | | | |")
                continue
            forwards = run["steps"][-1]["mtp_forwards"]
            peak = run["steps"][-1]["peak_gib"]
            lines.append(
                f"| {label} | {plugin} | {forwards['compute_log_prob']} / "
                f"{forwards['update_actor']} | {row(run, 'compute_log_prob', warmup)} "
                f"| {row(run, 'update_actor', warmup)} "
                f"| {peak['compute_log_prob']:.1f} / {peak['update_actor']:.1f} |"
            )
        if runs["with"] and runs["without"]:
            for call in ("compute_log_prob", "update_actor"):
                with_plugin = timing(runs["with"], call, warmup)[0]
                without = timing(runs["without"], call, warmup)[0]
                ratios.append(f"{label}, {call}: with / without = {with_plugin / without:.3f}")
    return "\n".join(lines + [""] + [f"- {r}" for r in ratios])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory", type=Path)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    print(table(args.directory, args.warmup))


if __name__ == "__main__":
    main()

"""The report of ``gpu_rl_drafter.py``: each goal with its number (:mod:`rl_drafter_goals`),
the arms' step times, and the plot.

``python benchmarks/rl_drafter/rl_drafter_report.py RUN.json [RUN.json ...] --out MERGED.json``
merges the arms of several runs into one report, after checking that the runs are the same
experiment:
the same arguments but for ``--arms`` and ``--out``, the same pretrained model (its figures
right after pretraining are equal), and equal rows for every arm that two runs share. The
script is deterministic, so that holds for runs that split the arms between them.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from rl_drafter_goals import DEPTH, _engine, baseline_ms, engine_length, goals


def arm_colours(results: dict) -> dict[str, tuple[float, ...]]:
    """One colour per arm, the same in every panel (arms in sorted order on ``tab10``)."""
    import matplotlib

    palette = matplotlib.colormaps["tab10"]
    return {arm: palette(i % 10) for i, arm in enumerate(sorted(results["arms"]))}


def report(results: dict) -> str:
    lines = ["| goal | met | numbers |", "|---|---|---|"]
    for goal, met, numbers in goals(results):
        lines.append(f"| {goal} | {'-' if met is None else 'yes' if met else 'no'} | {numbers} |")
    lines += ["", "| arm | train step ms (median) | MTP-trained steps |", "|---|---|---|"]
    for arm, data in results["arms"].items():
        base = baseline_ms(results, arm)
        against = "no A in its run" if base is None else f"A of its run: {base:.2f}"
        lines.append(
            f"| {arm} `{data['policy']}` | {statistics.median(data['train_step_ms']):.2f} "
            f"({against}) | {data['mtp_trained_steps']} |"
        )
    return "\n".join(lines)


def plot(results: dict, path: str) -> Any:
    """Draws the four panels to ``path`` and returns the figure; each arm keeps one colour
    throughout (:func:`arm_colours`), and k=0 is the same colour dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = results["arms"]
    colour = arm_colours(results)
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    ax = axes[0][0]
    for arm, data in arms.items():
        steps = [r["step"] for r in data["rows"]]
        lengths = [engine_length(r) for r in data["rows"]]
        ax.plot(steps, lengths, marker="o", color=colour[arm], label=arm)
    ax.set(title="engine accepted length (k=2)", xlabel="RL step", ylabel="tokens per step")
    ax.legend()
    ax = axes[0][1]
    for arm, data in arms.items():
        steps = [r["step"] for r in data["rows"]]
        for k, style in ((DEPTH, "-"), (0, ":")):
            ax.plot(
                steps,
                [_engine(r, k)["tokens_per_s"] for r in data["rows"]],
                style,
                color=colour[arm],
                label=f"{arm} k={k}",
            )
    ax.set(title="output tokens/s (batch of prompts)", xlabel="RL step")
    ax.legend(fontsize=7, ncol=2)
    ax = axes[1][0]
    names = list(arms)
    medians = [statistics.median(arms[a]["train_step_ms"]) for a in names]
    for name, value in zip(names, medians, strict=True):
        ax.bar(name, value, color=colour[name], label=name)
    ax.set(title="train step, median ms", ylabel="ms")
    ax = axes[1][1]
    for arm, data in arms.items():
        ax.scatter(
            [engine_length(r) for r in data["rows"]],
            [r["teacher_forced"]["accepted_length"] for r in data["rows"]],
            color=colour[arm],
            label=arm,
        )
    ax.plot([0, DEPTH], [0, DEPTH], "k:")
    ax.set(
        title="teacher-forced vs engine accepted length", xlabel="engine", ylabel="teacher-forced"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return fig


def merge(runs: list[dict]) -> dict:
    """One result with the arms of ``runs``, refused unless they are the same experiment."""
    first = runs[0]
    same = {k: v for k, v in first["args"].items() if k not in ("arms", "out")}
    merged = {**first, "arms": {}, "merged_from": len(runs)}
    for run in runs:
        args = {k: v for k, v in run["args"].items() if k not in ("arms", "out")}
        if args != same:
            raise SystemExit("rl_drafter_report: the runs were made with different arguments")
        tf = run["fresh_on_old_data"]["teacher_forced"]
        if tf != first["fresh_on_old_data"]["teacher_forced"]:
            raise SystemExit("rl_drafter_report: the runs pretrained different models")
        for arm, data in run["arms"].items():
            if arm in merged["arms"]:
                ours = [r["teacher_forced"] for r in merged["arms"][arm]["rows"]]
                if ours != [r["teacher_forced"] for r in data["rows"]]:
                    raise SystemExit(f"rl_drafter_report: arm {arm} differs between the runs")
                continue
            merged["arms"][arm] = {k: v for k, v in data.items() if k != "trunk_vs_A"}
            if "A" in run["arms"]:  # step times vary between runs: set against that run's A
                merged["arms"][arm]["baseline_ms"] = statistics.median(
                    run["arms"]["A"]["train_step_ms"]
                )
    for arm in merged["arms"]:  # trunk comparisons hold only within the run that had A
        for run in runs:
            if "A" in run["arms"] and "trunk_vs_A" in run["arms"].get(arm, {}):
                merged["arms"][arm]["trunk_vs_A"] = run["arms"][arm]["trunk_vs_A"]
                break
    merged["arms"] = dict(sorted(merged["arms"].items()))
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description="Merge runs of gpu_rl_drafter.py and report.")
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--out", required=True, help="the merged JSON (and a PNG beside it)")
    args = parser.parse_args()
    runs = []
    for path in args.runs:
        with open(path) as f:
            runs.append(json.load(f))
    merged = merge(runs)
    with open(args.out, "w") as f:
        json.dump(merged, f, indent=1)
    print(report(merged))
    plot(merged, args.out.rsplit(".", 1)[0] + ".png")


if __name__ == "__main__":
    main()

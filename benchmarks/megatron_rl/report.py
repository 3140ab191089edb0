"""The megatron_rl runs side by side: per-arm summaries, a markdown table and one plot.

    python report.py RUN.jsonl [RUN.jsonl ...] --out DIR

Each file is one arm's record from :mod:`steps` (its first line names the arm and its
arguments; then one line a step, and the step's ``train_s`` on a line of its own). The report
joins them per step, writes ``DIR/summary.json``, prints a markdown table, and draws
``DIR/megatron_rl.png``: reward, the engine's accepted length and the step time against the
step, one colour per run in every panel. Medians leave out step 1 (compilation and the first
CUDA allocations). The goals are judged on unpacked runs (``--packed``: on packed ones), and a
run that packs its sequences beside an unpacked run alike in all else gets a table of its
own: each phase's median over the steps both reached, and packed over unpacked.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import replace
from typing import Any

from goals import goals, kind

PHASES = ("rollout_s", "old_logprob_s", "ref_logprob_s", "train_s")


def load(path: str) -> dict[str, Any]:
    """One run: its ``meta`` line and its ``steps``, each step's lines joined."""
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    if not lines or "arm" not in lines[0]:
        raise SystemExit(f"{path}: no header line naming the arm; is it a steps.py record?")
    steps: dict[int, dict[str, Any]] = {}
    for line in lines[1:]:
        steps.setdefault(line["step"], {}).update(line)
    name = os.path.splitext(os.path.basename(path))[0]
    return {"name": name, "meta": lines[0], "steps": [steps[k] for k in sorted(steps)]}


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def step_value(step: dict[str, Any], key: str) -> float | None:
    """A step's phase timer or tokens/s, or ``step_s``: its phases' sum, where it has them all."""
    if key != "step_s":
        return step.get(key)
    return sum(step[p] for p in PHASES) if all(step.get(p) is not None for p in PHASES) else None


def median_over(steps: list[dict[str, Any]], key: str) -> float | None:
    """The median of :func:`step_value` over ``steps``, where they have it."""
    return median([value for s in steps if (value := step_value(s, key)) is not None])


def summary(run: dict[str, Any]) -> dict[str, Any]:
    """Medians of the phase timers and tokens/s (step 1 left out), and what each step holds."""
    steps = run["steps"]
    later = steps[1:] if len(steps) > 1 else steps
    out: dict[str, Any] = {
        "arm": run["meta"]["arm"],
        "policy": run["meta"]["policy"],
        "steps": len(steps),
        "complete_steps": sum(all(s.get(p) is not None for p in PHASES) for s in steps),
        "mtp_trained_steps": sum(bool(s.get("mtp_trained")) for s in steps),
    }
    for key in (*PHASES, "tokens_per_s", "step_s"):
        out[f"median_{key}"] = median_over(later, key)
    out["reward"] = [s.get("reward") for s in steps]
    out["accepted_length"] = [(s.get("spec") or {}).get("accepted_length") for s in steps]
    return out


def table(summaries: dict[str, dict[str, Any]]) -> str:
    """A markdown table, one row a run."""

    def cell(value: Any) -> str:
        return "-" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)

    rows = [
        "| run | arm | steps | MTP trained | rollout s | old log-p s | ref log-p s | train s "
        "| step s | tokens/s | reward first/last | accepted length last |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summaries.items():
        rewards = [r for r in s["reward"] if r is not None]
        lengths = [a for a in s["accepted_length"] if a is not None]
        reward = f"{cell(rewards[0])} / {cell(rewards[-1])}" if rewards else "-"
        rows.append(
            f"| {name} | {s['arm']} | {s['steps']} | {s['mtp_trained_steps']} | "
            + " | ".join(
                cell(s[f"median_{k}"])
                for k in (
                    "rollout_s",
                    "old_logprob_s",
                    "ref_logprob_s",
                    "train_s",
                    "step_s",
                    "tokens_per_s",
                )
            )  # fmt: skip
            + f" | {reward} | {cell(lengths[-1] if lengths else None)} |"
        )
    return "\n".join(rows)


def packing(runs: list[dict[str, Any]]) -> str:
    """A markdown table for each pair of runs alike but for sequence packing: each phase's
    median over the steps from 2 on that both reached, and packed over unpacked; ``""``
    where no pair is alike."""
    rows = []
    for packed in runs:
        if not kind(packed).packed:
            continue
        alike = replace(kind(packed), packed=False)
        for plain in (run for run in runs if kind(run) == alike):
            reached = min(len(packed["steps"]), len(plain["steps"]))
            cells = []
            for key in (*PHASES, "step_s", "tokens_per_s"):
                pair = [median_over(run["steps"][1:reached], key) for run in (packed, plain)]
                shown = " / ".join("-" if v is None else f"{v:.3g}" for v in pair)
                ratio = f" ({pair[0] / pair[1]:.2f}x)" if None not in pair and pair[1] else ""
                cells.append(shown + ratio)
            rows.append(
                f"| {packed['name']} / {plain['name']} | 2-{reached} | " + " | ".join(cells) + " |"
            )
    if not rows:
        return ""
    head = (
        "| packed / unpacked | steps | rollout s | old log-p s | ref log-p s | train s | step s "
        "| tokens/s |\n|---|---|---|---|---|---|---|---|"
    )
    return head + "\n" + "\n".join(rows)


def plot(runs: list[dict[str, Any]], path: str) -> None:
    """Reward, accepted length and step time against the step; one colour per run throughout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = plt.get_cmap("tab10")
    figure, axes = plt.subplots(1, 3, figsize=(15, 4))
    panels = (
        ("reward", lambda s: s.get("reward")),
        ("engine accepted length", lambda s: (s.get("spec") or {}).get("accepted_length")),
        ("step time (s)", lambda s: step_value(s, "step_s")),
    )
    for index, run in enumerate(runs):
        colour = colours(index % 10)  # by run, the same in every panel
        for axis, (title, value) in zip(axes, panels, strict=True):
            points = [(s["step"], value(s)) for s in run["steps"] if value(s) is not None]
            if points:
                xs, ys = zip(*points, strict=True)
                axis.plot(xs, ys, marker="o", color=colour, label=run["name"])
            axis.set_title(title)
            axis.set_xlabel("GRPO step")
    axes[0].legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="+")
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--packed",
        action="store_true",
        help="judge the goals on the runs that pack their sequences (default: those that do not)",
    )
    parser.add_argument(
        "--shared",
        default="",
        help="runs (by file name, comma-separated) that shared the GPU, so their timers answer "
        "no timing goal; run.sh isolated marks its runs itself",
    )
    args = parser.parse_args(argv)
    runs = [load(path) for path in args.records]
    summaries = {run["name"]: summary(run) for run in runs}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summaries, f, indent=1)
    plot(runs, os.path.join(args.out, "megatron_rl.png"))
    print(table(summaries))
    print()
    shared = frozenset(filter(None, args.shared.split(",")))
    print(goal_table(goals(runs, shared, args.packed)))
    packed = packing(runs)
    if packed:
        print()
        print(packed)
    return summaries


def goal_table(rows: list[tuple[str, bool | None, str]]) -> str:
    lines = ["| goal | met | numbers |", "|---|---|---|"]
    for goal, met, numbers in rows:
        lines.append(f"| {goal} | {'-' if met is None else 'yes' if met else 'no'} | {numbers} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

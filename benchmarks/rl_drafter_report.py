"""The report of ``gpu_rl_drafter.py``: each goal with its number, and the plot.

``python benchmarks/rl_drafter_report.py RUN.json [RUN.json ...] --out MERGED.json`` merges the
arms of several runs into one report, after checking that the runs are the same experiment:
the same arguments but for ``--arms`` and ``--out``, the same pretrained model (its figures
right after pretraining are equal), and equal rows for every arm that two runs share. The
script is deterministic, so that holds for runs that split the arms between them.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

DEPTH = 2


def _engine(row: dict, k: int) -> dict:
    """The figures of drafting ``k`` tokens (keys are ints in memory, strings in JSON)."""
    return row["engine"][str(k) if str(k) in row["engine"] else k]


def engine_length(row: dict, k: int = DEPTH) -> float:
    return _engine(row, k).get("accepted_length", 0.0)


def goals(results: dict) -> list[tuple[str, bool | None, str]]:
    """``(goal, met, the numbers)`` for every goal of the experiment (``met`` None: not run)."""
    arms = results["arms"]
    out: list[tuple[str, bool | None, str]] = []
    if "A" in arms:
        rows = arms["A"]["rows"]
        first, last = rows[0], rows[-1]
        drops = [
            _engine(first, DEPTH).get("chain_acceptance", [0, 0])[i]
            - min(_engine(r, DEPTH).get("chain_acceptance", [0, 0])[i] for r in rows)
            for i in range(DEPTH)
        ]
        out.append(
            (
                "A's engine acceptance falls by >= 0.2 over the RL phase",
                max(drops) >= 0.2,
                f"drop per position {', '.join(f'{d:.3f}' for d in drops)}; accepted length "
                f"{engine_length(first):.3f} -> {engine_length(last):.3f}",
            )
        )
    same = {a: arms[a].get("trunk_vs_A") for a in arms if "trunk_vs_A" in arms[a]}
    if same:
        detached = [a for a in ("C", "D") if a in same]
        out.append(
            (
                "A, C and D end with bit-identical trunk weights",
                all(same[a]["bit_identical"] for a in detached) if detached else None,
                "; ".join(
                    f"{a}: {'identical' if s['bit_identical'] else 'differs'} "
                    f"(max |diff| {s['max_abs_diff']:.3g})"
                    for a, s in same.items()
                ),
            )
        )
    if "B" in arms and "D" in arms:
        ratios = [
            engine_length(d) / engine_length(b) if engine_length(b) else float("nan")
            for b, d in zip(arms["B"]["rows"], arms["D"]["rows"], strict=True)
        ]
        cost = mtp_cost(results)
        within = all(r >= 0.9 for r in ratios)
        share = arms["D"]["mtp_trained_steps"] / max(arms["B"]["mtp_trained_steps"], 1)
        cheap = share <= 0.5
        out.append(
            (
                "D holds the engine's accepted length within 10% of B's at every measurement",
                within,
                f"D/B per measurement {', '.join(f'{r:.3f}' for r in ratios)}",
            )
        )
        out.append(
            (
                "D's MTP training costs at most 50% of B's",
                cheap,
                f"steps that trained MTP: B {arms['B']['mtp_trained_steps']}, "
                f"D {arms['D']['mtp_trained_steps']} ({share:.0%} of B's); mean train-step ms "
                "over A's median: " + ", ".join(f"{a} {c:+.2f}" for a, c in cost.items()),
            )
        )
    if "P" in arms and "R" in arms:
        p_rows, r_rows = arms["P"]["rows"], arms["R"]["rows"]
        ratios = [
            engine_length(r) / engine_length(p) if engine_length(p) else float("nan")
            for p, r in zip(p_rows, r_rows, strict=True)
        ]
        same = arms["R"].get("trunk_vs_P", {}).get("bit_identical")
        out.append(
            (
                "MTP trained on the response only drafts at least as well as MTP trained on "
                "prompt, response and padding, at the last measurement",
                ratios[-1] >= 1.0,
                f"R/P per measurement {', '.join(f'{r:.3f}' for r in ratios)}; accepted length "
                f"P {engine_length(p_rows[0]):.3f} -> {engine_length(p_rows[-1]):.3f}, R "
                f"{engine_length(r_rows[0]):.3f} -> {engine_length(r_rows[-1]):.3f} (teacher-"
                f"forced at the last: P {p_rows[-1]['teacher_forced']['accepted_length']:.3f}, R "
                f"{r_rows[-1]['teacher_forced']['accepted_length']:.3f}); the two "
                f"policies {'bit-identical' if same else 'differ' if same is False else 'n/a'}",
            )
        )
    fresh = results["fresh_on_old_data"]
    speedups = {
        batch: _engine(fresh, DEPTH)[key] / _engine(fresh, 0)[key]
        for batch, key in (("1", "batch1_tokens_per_s"), ("8", "tokens_per_s"))
    }
    out.append(
        (
            "A fresh drafter gives >= 1.3x the tokens/s of no speculation at batch 1",
            speedups["1"] >= 1.3,
            f"k={DEPTH}: {speedups['1']:.3f}x at batch 1, {speedups['8']:.3f}x at batch "
            f"{results['args']['prompts']}; accepted length {engine_length(fresh):.3f}",
        )
    )
    worst_best, worst_none, n = 1.0, float("inf"), 0
    for arm in arms.values():
        for row in arm["rows"]:
            tps = {int(k): e["tokens_per_s"] for k, e in row["engine"].items()}
            chosen = tps[row["recommended_k"]]
            worst_best = min(worst_best, chosen / max(tps.values()))
            worst_none = min(worst_none, chosen / tps[0])
            n += 1
    out.append(
        (
            "The recommended k is never > 5% slower than the best fixed k, nor slower than k=0",
            worst_best >= 0.95 and worst_none >= 1.0,
            f"over {n} measurements: worst recommended/best {worst_best:.3f}, "
            f"worst recommended/k=0 {worst_none:.3f}",
        )
    )
    sampling = results["args"].get("temperature", 0.0) > 0
    figure = "sampled_accepted_length" if sampling else "accepted_length"
    pairs = [
        (row["teacher_forced"].get(figure), engine_length(row))
        for arm in arms.values()
        for row in arm["rows"]
        if engine_length(row) > 0.2 and row["teacher_forced"].get(figure) is not None
    ]
    if pairs:
        errors = [abs(t - e) / e for t, e in pairs]
        bound = 0.10 if sampling else 0.05
        out.append(
            (
                f"Teacher-forced {figure.replace('_', ' ')} predicts the engine's within "
                f"{bound:.0%} (engine length above 0.2)",
                max(errors) <= bound,
                f"relative error over {len(pairs)} measurements: median "
                f"{statistics.median(errors):.3f}, max {max(errors):.3f}",
            )
        )
    out.extend(objective_goals(results, sampling))
    return out


def objective_goals(results: dict, sampling: bool) -> list[tuple[str, bool | None, str]]:
    """The goals of the objective arms K (``kl``) and T (``tv``) against C (``ce``)."""
    arms = results["arms"]
    if "C" not in arms or not {"K", "T"} & set(arms):
        return []
    out: list[tuple[str, bool | None, str]] = []
    c_rows = arms["C"]["rows"]
    ratios = {
        arm: [
            engine_length(r) / engine_length(c) if engine_length(c) else float("nan")
            for c, r in zip(c_rows, arms[arm]["rows"], strict=True)
        ]
        for arm in ("K", "T")
        if arm in arms
    }
    listed = "; ".join(f"{a}/C {', '.join(f'{x:.3f}' for x in r)}" for a, r in ratios.items())
    if sampling:  # the first measurement is before the shift; the next one is the first after
        after = {a: r[1:] for a, r in ratios.items()}
        holds = any(r and min(r) >= 1.0 and r[0] >= 1.15 for r in after.values())
        goal = "Sampled: K or T at least C's after the shift, and 1.15x at the first after it"
    else:
        holds = all(min(r) >= 0.95 for r in ratios.values())
        goal = "Greedy: neither K nor T below 0.95x C's accepted length at any measurement"
    out.append((goal, holds, listed))
    c_ms = statistics.median(arms["C"]["train_step_ms"])
    costs = {a: statistics.median(arms[a]["train_step_ms"]) / c_ms for a in ratios}
    out.append(
        (
            "An MTP-trained step under K or T costs at most 1.15x C's (median)",
            all(c <= 1.15 for c in costs.values()),
            ", ".join(f"{a} {c:.3f}x" for a, c in costs.items()),
        )
    )
    same = {a: arms[a].get("trunk_vs_C", {}).get("bit_identical") for a in ratios}
    out.append(
        (
            "K's and T's trunks end bit-identical to C's (no distillation target trains them)",
            all(same.values()) if None not in same.values() else None,
            ", ".join(f"{a}: {s}" for a, s in same.items()),
        )
    )
    return out


def baseline_ms(results: dict, arm: str) -> float | None:
    """The train-step median of arm A of ``arm``'s own run: set by :func:`merge` for merged
    runs; in a single run, A's median from ``results``; ``None`` where no A ran with it."""
    data = results["arms"][arm]
    if "baseline_ms" in data:
        return data["baseline_ms"]
    if "A" in results["arms"] and results.get("merged_from") is None:
        return statistics.median(results["arms"]["A"]["train_step_ms"])
    return None


def mtp_cost(results: dict) -> dict[str, float]:
    """Per arm, the mean train-step time over its run's A median: what training MTP cost per
    step. Arms whose run had no A are left out."""
    costs = {}
    for arm, data in results["arms"].items():
        base = baseline_ms(results, arm)
        if base is not None:
            costs[arm] = statistics.fmean(data["train_step_ms"]) - base
    return costs


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

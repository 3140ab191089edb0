"""The goals of ``gpu_rl_drafter.py``, each with its number: what ``rl_drafter_report.py``
prints as its first table. ``met`` is ``None`` where an arm a goal needs did not run."""

from __future__ import annotations

import statistics

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
            length_ratio(d, b) for b, d in zip(arms["B"]["rows"], arms["D"]["rows"], strict=True)
        ]
        cost = mtp_cost(results)
        within = all(even(r) >= 0.9 for r in ratios)
        share = arms["D"]["mtp_trained_steps"] / max(arms["B"]["mtp_trained_steps"], 1)
        cheap = share <= 0.5
        out.append(
            (
                "D holds the engine's accepted length within 10% of B's at every measurement",
                within,
                f"D/B per measurement {listing(ratios)}",
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
        ratios = [length_ratio(r, p) for p, r in zip(p_rows, r_rows, strict=True)]
        same = arms["R"].get("trunk_vs_P", {}).get("bit_identical")
        out.append(
            (
                "MTP trained on the response only drafts at least as well as MTP trained on "
                "prompt, response and padding, at the last measurement",
                even(ratios[-1]) >= 1.0,
                f"R/P per measurement {listing(ratios)}; accepted length "
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
    out.extend(
        prediction_goal(results, sampling, figure, "accepted_length", "the engine's", "engine")
    )
    out.extend(single_position_goal(results, sampling))
    out.extend(objective_goals(results, sampling))
    return out


def single_position_goal(results: dict, sampling: bool) -> list[tuple[str, bool | None, str]]:
    """The single-position figure (drafts computed as megatron's engine computes them) against
    the engine drafting one request at a time, where a run measured both."""
    figure = "single_position_" + ("sampled_" if sampling else "") + "accepted_length"
    against = "the engine drafting one request at a time"
    return prediction_goal(results, sampling, figure, "alone_accepted_length", against, "its")


def prediction_goal(
    results: dict, sampling: bool, figure: str, engine_key: str, against: str, whose: str
) -> list[tuple[str, bool | None, str]]:
    """Teacher-forced ``figure`` against the engine's ``engine_key`` (drafting ``DEPTH``
    tokens), within 10% under sampling and 5% greedy, over the measurements where the engine's
    figure is above 0.2; nothing where no measurement has both."""
    pairs = []
    for arm in results["arms"].values():
        for row in arm["rows"]:
            engine = _engine(row, DEPTH).get(engine_key)
            value = row["teacher_forced"].get(figure)
            if engine is not None and engine > 0.2 and value is not None:
                pairs.append((value, engine))
    if not pairs:
        return []
    errors = [abs(t - e) / e for t, e in pairs]
    bound = 0.10 if sampling else 0.05
    return [
        (
            f"Teacher-forced {figure.replace('_', ' ')} predicts {against} within {bound:.0%} "
            f"({whose} length above 0.2)",
            max(errors) <= bound,
            f"relative error over {len(pairs)} measurements: median "
            f"{statistics.median(errors):.3f}, max {max(errors):.3f}",
        )
    ]


def objective_goals(results: dict, sampling: bool) -> list[tuple[str, bool | None, str]]:
    """The goals of the objective arms K (``kl``) and T (``tv``) against C (``ce``)."""
    arms = results["arms"]
    if "C" not in arms or not {"K", "T"} & set(arms):
        return []
    out: list[tuple[str, bool | None, str]] = []
    c_rows = arms["C"]["rows"]
    ratios = {
        arm: [length_ratio(r, c) for c, r in zip(c_rows, arms[arm]["rows"], strict=True)]
        for arm in ("K", "T")
        if arm in arms
    }
    listed = "; ".join(f"{a}/C {listing(r)}" for a, r in ratios.items())
    if sampling:  # the first measurement is before the shift; the next one is the first after
        after = {a: r[1:] for a, r in ratios.items()}
        holds = any(r and min(map(even, r)) >= 1.0 and even(r[0]) >= 1.15 for r in after.values())
        goal = "Sampled: K or T at least C's after the shift, and 1.15x at the first after it"
    else:
        holds = all(min(map(even, r)) >= 0.95 for r in ratios.values())
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


def length_ratio(row: dict, base: dict) -> float | None:
    """``row``'s engine accepted length over ``base``'s: ``inf`` where only the base drafted
    nothing, ``None`` where neither drafted anything (no ratio, and no difference)."""
    if engine_length(base):
        return engine_length(row) / engine_length(base)
    return float("inf") if engine_length(row) else None


def even(ratio: float | None) -> float:
    """A ratio for a goal's comparison: two arms that both drafted nothing are level."""
    return 1.0 if ratio is None else ratio


def listing(ratios: list[float | None]) -> str:
    return ", ".join("-" if r is None else f"{r:.3f}" for r in ratios)


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

"""The GRPO benchmark's goals (issue #39), each as met, not met or not measured, from the runs.

:func:`goals` reads the runs :func:`report.load` gives and finds each goal's runs by what they
are, not by their names: the arm, the speculative tokens ``k``, the response mask, local CUDA
graphs and the MTP depth, all read from each record's header line. A goal whose runs are
missing, too short, or (for a timing goal) ran while other arms shared the GPU reads
``None``: not measured. Runs started by ``run.sh isolated`` say ``"shared_gpu": true`` in their
header; ``report.py --shared NAME,...`` marks older records the same way.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

Goal = tuple[str, bool | None, str]

FRESH_AFTER = 10  # "at every logged step after the first 10"


@dataclass(frozen=True)
class Kind:
    """What a run is, read from its header line."""

    arm: str
    k: int
    mask: bool
    graphs: bool
    mtp_layers: int
    packed: bool = False


def kind(run: dict[str, Any]) -> Kind:
    argv: list[str] = run["meta"].get("argv", [])

    def option(name: str, default: str) -> str:
        return argv[argv.index(name) + 1] if name in argv else default

    return Kind(
        arm=run["meta"]["arm"],
        k=int(option("--num-speculative-tokens", "0")),
        mask=bool(run["meta"].get("mask", True)),
        graphs=option("--cuda-graph-impl", "none") == "local",
        mtp_layers=mtp_depths(argv),
        packed="--rl-use-sequence-packing" in argv,
    )


def mtp_depths(argv: list[str]) -> int:
    """The MTP depths a run's model has: ``--mtp-num-layers``, or for a hybrid model the
    segments after the trunk in ``--hybrid-layer-pattern`` (``MEM*E/*E/*E``: two)."""
    if "--mtp-num-layers" in argv:
        return int(argv[argv.index("--mtp-num-layers") + 1])
    if "--hybrid-layer-pattern" in argv:
        return argv[argv.index("--hybrid-layer-pattern") + 1].count("/")
    return 0


def lengths(run: dict[str, Any]) -> dict[int, float]:
    """The engine's accepted length per step, where the step drafted."""
    out = {}
    for step in run["steps"]:
        length = (step.get("spec") or {}).get("accepted_length")
        if length is not None:
            out[step["step"]] = length
    return out


def rewards(run: dict[str, Any]) -> list[float]:
    return [s["reward"] for s in run["steps"] if s.get("reward") is not None]


def step_sums(run: dict[str, Any], *keys: str) -> list[float]:
    """The sum of ``keys`` at each step from step 2 on that has them all (step 1 starts up)."""
    return [sum(s[k] for k in keys) for s in run["steps"][1:] if all(k in s for k in keys)]


def median_of(run: dict[str, Any], *keys: str) -> float | None:
    """The median over steps 2 on of the sum of ``keys``, where a step has them all."""
    values = step_sums(run, *keys)
    return statistics.median(values) if values else None


def spread(run: dict[str, Any], *keys: str) -> str:
    """The lowest and highest sum of ``keys`` over steps 2 on: how far one run's steps vary."""
    values = step_sums(run, *keys)
    return f"{min(values):.2f}-{max(values):.2f}" if values else "-"


def goals(
    runs: list[dict[str, Any]], shared: frozenset[str] = frozenset(), packed: bool = False
) -> list[Goal]:
    """``(goal, met, the numbers)`` for each of the issue's goals; ``met`` None: not measured.
    Only the runs packed as ``packed`` say, so that a goal never compares a packed run's
    timers with an unpacked one's."""
    runs = [run for run in runs if kind(run).packed == packed]
    kinds = {run["name"]: kind(run) for run in runs}

    def find(alone: bool = False, **want: Any) -> list[dict[str, Any]]:
        return [
            run
            for run in runs
            if all(getattr(kinds[run["name"]], key) == value for key, value in want.items())
            and not (alone and (run["name"] in shared or run["meta"].get("shared_gpu")))
        ]

    def first(**want: Any) -> dict[str, Any] | None:
        found = find(**want)
        return max(found, key=lambda r: len(r["steps"])) if found else None

    out: list[Goal] = [zero_edits(runs)]
    m2 = first(arm="M", k=2, graphs=False, mtp_layers=2)
    out.append(stale_falls(first(arm="S", k=2, graphs=False)))
    out.append(fresh(m2, [first(arm=a, k=2, mask=True, graphs=False) for a in ("H", "A")]))
    out.append(controller_share(first(arm="A", k=2)))
    out.append(response_only(m2, first(arm="H", k=2, mask=True, graphs=False)))
    pairs = {}  # (arm, local CUDA graphs) -> (k=2, k=0), each alone on the GPU
    for arm in ("H", "M"):
        for graphs in (False, True):
            fast = first(alone=True, arm=arm, k=2, graphs=graphs, mtp_layers=2)
            slow = first(alone=True, arm=arm, k=0, graphs=graphs, mtp_layers=2)
            if fast is not None and slow is not None:
                pairs[(arm, graphs)] = (fast, slow)
    out.append(speed(pairs))
    out.append(
        step_saving(
            first(alone=True, arm="H", k=2, graphs=False, mask=True),
            first(alone=True, arm="M", k=2, graphs=False, mtp_layers=2),
        )
    )
    none = first(alone=True, mtp_layers=0)
    like = kinds[none["name"]] if none is not None else None  # H with N's k and graphs
    out.append(
        logprob_cost(
            first(alone=True, arm="H", mtp_layers=2, k=like.k, graphs=like.graphs)
            if like is not None
            else None,
            none,
        )
    )
    out.append(interference(find(k=0, mtp_layers=2), kinds))
    return out


def zero_edits(runs: list[dict[str, Any]]) -> Goal:
    # launch.py refuses a tree that is not byte for byte a pinned one, before the header
    checked = [r for r in runs if (r["meta"].get("megatron_lm") or {}).get("digest")]
    trees = sorted({r["meta"]["megatron_lm"]["name"] for r in checked})
    return (
        "Zero edits: Megatron-LM's files byte-identical to the pinned commit",
        len(checked) == len(runs) if runs else None,
        f"{len(checked)} of {len(runs)} runs checked by digest ({', '.join(trees) or 'none'})",
    )


def stale_falls(s2: dict[str, Any] | None) -> Goal:
    goal = f"Freshness: S's accepted length falls by at least 0.2 (step 1 to after {FRESH_AFTER})"
    later = [v for step, v in lengths(s2).items() if step > FRESH_AFTER] if s2 else []
    if s2 is None or 1 not in lengths(s2) or not later:
        return goal, None, "no S run with k=2 past step 10"
    start, end = lengths(s2)[1], statistics.median(later)
    numbers = f"{s2['name']}: {start:.3f} -> median {end:.3f} over steps {FRESH_AFTER + 1}+"
    return goal, start - end >= 0.2, numbers + f" (drop {start - end:.3f})"


def fresh(m2: dict[str, Any] | None, arms: list[dict[str, Any] | None]) -> Goal:
    goal = f"Freshness: H and A within 10% of M's accepted length at every step after {FRESH_AFTER}"
    if m2 is None or any(a is None for a in arms):
        return goal, None, "needs M, H and A with k=2"
    base, parts, holds = lengths(m2), [], True
    for run in arms:
        assert run is not None
        ratios = {
            s: v / base[s] for s, v in lengths(run).items() if s > FRESH_AFTER and base.get(s)
        }
        if not ratios:
            return (
                goal,
                None,
                f"{run['name']} ran {len(run['steps'])} steps, none past {FRESH_AFTER}",
            )
        holds = holds and min(ratios.values()) >= 0.9
        part = f"{run['name']}/M {min(ratios.values()):.2f}-{max(ratios.values()):.2f}"
        if len(run["steps"]) < len(m2["steps"]):
            part += f" (stopped after step {len(run['steps'])} of {len(m2['steps'])})"
        parts.append(part)
    return goal, holds, "; ".join(parts)


def controller_share(a2: dict[str, Any] | None) -> Goal:
    goal = "A trains MTP on at most 50% of the steps"
    if a2 is None or not a2["steps"]:
        return goal, None, "no A run"
    trained = sum(bool(s.get("mtp_trained")) for s in a2["steps"])
    share = trained / len(a2["steps"])
    numbers = f"{a2['name']}: {trained} of {len(a2['steps'])} steps ({share:.0%})"
    if len(a2["steps"]) <= FRESH_AFTER:  # the controller needs the policy to move first
        return goal, None, numbers + f"; too short to judge (at most {FRESH_AFTER} steps)"
    return goal, share <= 0.5, numbers


def response_only(m2: dict[str, Any] | None, h2: dict[str, Any] | None) -> Goal:
    goal = "Response-only: H's accepted length at least M's at the end of the run"
    if m2 is None or h2 is None:
        return goal, None, "needs M and H with k=2"
    h, m = lengths(h2), lengths(m2)
    common = sorted(set(h) & set(m))
    if not common:
        return goal, None, "no step both drafted"
    last = common[-1]
    numbers = f"at step {last}: H {h[last]:.3f}, M {m[last]:.3f} ({h[last] / m[last]:.2f}x)"
    if len(h2["steps"]) < len(m2["steps"]):
        return (
            goal,
            None,
            numbers + f"; H stopped at step {len(h2['steps'])} of M's {len(m2['steps'])}",
        )
    return goal, h[last] >= m[last], numbers


ROLLOUT_WINDOW_FROM = 20
"""The rollout goal is read over steps 20 on: the drafter is trained by then, and the early
steps, where its acceptance still climbs, would decide a median over the whole run."""


def rollout_medians(fast: dict[str, Any], slow: dict[str, Any]) -> tuple[int, float, float] | None:
    """``(first step, k=2 median, k=0 median)`` of tokens/s over the goal's window, or, where
    either run stopped before it, over the later half of the steps both reached (step 2 on);
    a step only one of the two reached is left out of both."""
    last = min(len(fast["steps"]), len(slow["steps"]))
    start = ROLLOUT_WINDOW_FROM if last >= ROLLOUT_WINDOW_FROM else max(2, last // 2 + 1)

    def median(run: dict[str, Any]) -> float | None:
        values = [
            s["tokens_per_s"]
            for s in run["steps"]
            if start <= s["step"] <= last and "tokens_per_s" in s
        ]
        return statistics.median(values) if values else None

    fast_median, slow_median = median(fast), median(slow)
    if fast_median is None or slow_median is None:
        return None
    return start, fast_median, slow_median


def speed(pairs: dict[tuple[str, bool], tuple[dict[str, Any], dict[str, Any]]]) -> Goal:
    """Each arm's k=2 against its k=0, eager and under local CUDA graphs, where both ran alone,
    over steps 20 on (``ROLLOUT_WINDOW_FROM``).

    H's pairs decide, and one H pair at 1.3x or more meets the goal (a user rolls out in the
    faster mode); M's pairs are reported beside them. A pair that stopped before step 20 is not
    judged: its numbers are the later half of the steps both reached, marked as such."""
    goal = "Rollouts: H's drafter with k=2 gives at least 1.3x the tokens/s of k=0, steps 20 on"
    readings, judged = [], []
    for (arm, graphs), (fast_run, slow_run) in sorted(pairs.items()):
        medians = rollout_medians(fast_run, slow_run)
        if medians is None:
            continue
        start, fast, slow = medians
        name = f"{arm} {'local graphs' if graphs else 'eager'}"
        if start == ROLLOUT_WINDOW_FROM:
            window = f"steps {start} on"
            if arm == "H":
                judged.append(fast / slow)
        else:
            ended = min(len(fast_run["steps"]), len(slow_run["steps"]))
            window = f"steps {start}-{ended} only, not judged: a run ended before step 20"
        readings.append(
            f"{name}: {fast:.0f} against {slow:.0f} tokens/s ({fast / slow:.2f}x, {window})"
        )
    numbers = "; ".join(readings)
    if not judged:
        missing = "needs H with k=2 and k=0, alone, to step 20"
        return goal, None, f"{numbers}; {missing}" if numbers else missing
    return goal, max(judged) >= 1.3, numbers


def step_saving(h2: dict[str, Any] | None, m2: dict[str, Any] | None) -> Goal:
    goal = "H's whole GRPO step is faster than M's (by what its log-prob passes save)"
    if h2 is None or m2 is None:
        return goal, None, "needs H and M with k=2, each alone on the GPU"
    keys = ("rollout_s", "old_logprob_s", "ref_logprob_s", "train_s")
    h_step, m_step = median_of(h2, *keys), median_of(m2, *keys)
    h_logp = median_of(h2, "old_logprob_s", "ref_logprob_s")
    m_logp = median_of(m2, "old_logprob_s", "ref_logprob_s")
    if h_step is None or m_step is None or h_logp is None or m_logp is None:
        return goal, None, "a run has no step past the first"
    return (
        goal,
        h_step < m_step,
        f"step {h_step:.2f} against {m_step:.2f} s; log-prob passes {h_logp:.2f} against "
        f"{m_logp:.2f} s (saved {m_logp - h_logp:.2f}); per step (steps 2 on) H "
        f"{spread(h2, *keys)} and M {spread(m2, *keys)} s",
    )


def logprob_cost(h: dict[str, Any] | None, n: dict[str, Any] | None) -> Goal:
    goal = "The log-prob passes under H cost within 2% of a model built without MTP"
    if h is None or n is None:
        return goal, None, "needs H and a run with --mtp-num-layers 0, each alone on the GPU"
    mine, none = (
        median_of(h, "old_logprob_s", "ref_logprob_s"),
        median_of(n, "old_logprob_s", "ref_logprob_s"),
    )
    if mine is None or none is None:
        return goal, None, "a run has no step past the first"
    return (
        goal,
        mine / none <= 1.02,
        f"old + ref: {mine:.3f} against {none:.3f} s ({mine / none:.3f}x) ({h['name']} against "
        f"{n['name']}); per step (steps 2 on) {spread(h, 'old_logprob_s', 'ref_logprob_s')} "
        f"and {spread(n, 'old_logprob_s', 'ref_logprob_s')} s",
    )


def interference(k0: list[dict[str, Any]], kinds: dict[str, Kind]) -> Goal:
    goal = "No interference (k=0): S and H without the mask as equal as two runs of one arm"
    groups: dict[Kind, list[dict[str, Any]]] = {}
    for run in k0:
        groups.setdefault(kinds[run["name"]], []).append(run)
    reruns = next((g for g in groups.values() if len(g) > 1), None)
    s = next((g[0] for k, g in groups.items() if k.arm == "S"), None)
    h = next((g[0] for k, g in groups.items() if k.arm == "H" and not k.mask), None)
    if reruns is None or s is None or h is None:
        return goal, None, "needs one arm twice, S and H without the mask, all with k=0"
    one, two = rewards(reruns[0]), rewards(reruns[1])
    if one == two:
        return (
            goal,
            rewards(s) == rewards(h),
            "reruns bit-identical in reward; S and H "
            + ("equal" if rewards(s) == rewards(h) else "differ"),
        )
    spread = max(abs(a - b) for a, b in zip(one, two, strict=False))
    apart = max(abs(a - b) for a, b in zip(rewards(s), rewards(h), strict=False))
    numbers = (
        f"reruns not bit-identical: reward spread between them up to {spread:.3f} a step, "
        f"S-H up to {apart:.3f} (reported, not judged)"
    )
    return goal, None, numbers

"""GPU benchmark: one of ``gpu_mtp.py``'s two claims at a time, beside a control.

Run on one GPU: ``python benchmarks/gpu_hooks_ab.py --model gpt|hybrid [--pair run|skip]
[--spec local|te] [--fp8 delayed|tensorwise] [--rounds 150] [--out DIR]`` (model sizes as
``gpu_mtp.py``).

``gpu_mtp.py`` measures six cases in turn, so two of its cases stand a whole iteration of other
work apart; with Transformer Engine steps of 50-150 ms, the machine's jitter between them is
larger than the 0.5% and 1% that its claims are about. This benchmark measures three cases per
round, in an order that rotates every round:

* ``--pair run`` (the default): ``a``, the MTP model with no hooks; ``b``, the same model with
  ``mtp_hooks.attach`` and ``train=run,rollout=run,eval=run``; ``a2``, ``a`` again.
* ``--pair skip``: ``d``, the same architecture built without MTP; ``c``, the MTP model with
  every phase ``skip``; ``d2``, ``d`` again.
* ``--pair change``: what a decision change costs, train steps only. Every case runs an untimed
  train step and then the timed one; the MTP model stays attached. ``d``: built without MTP;
  ``s``: skipped in both steps, the policy untouched (the steady state); ``c``: skipped in both,
  with the policy set again between them (a new decision, the same answer); ``x``: MTP run in
  the first step and skipped in the timed one (the decision changed); ``w``: like ``s``, with
  the first step followed by matrix products that keep the GPU busy about as long as running
  MTP did in ``x`` (the control for the device's state after heavier work); ``d2``: ``d`` again.
  One round of ``s`` and ``x`` each is also run under ``torch.profiler``, and the operators that
  take the most host and device time are recorded.

With ``--profile``, the run and skip pairs also run one round of each case under
``torch.profiler`` after the timed rounds: per case, the host time (the operators' own CPU
time, summed), the device time (the kernels' own time, summed), the kernel launches, and the
operators that take the most of each. Where the device time of two cases agrees and their
wall time does not, the difference is on the host.

The third case is the control: ``a2/a`` (or ``d2/d``) shows how far two identical cases read
apart on this machine, which is the resolution of the claim's ratio.

Each case runs a train step (forward + backward), a forward-only log-prob pass (``no_grad``,
phase ``rollout``) and an eval forward (``eval()``, ``no_grad``, labels). A ratio is the median
over rounds of the ratio taken within the round, with a 95% bootstrap interval of that median.
Output: a JSON line and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_mtp import (  # noqa: E402
    SIZES,
    add_model_arguments,
    batch_and_steps,
    build_models,
    check_device,
    megatron_core_version,
    time_steps,
    timed,
)
from gpu_mtp_report import TIMINGS  # noqa: E402

PAIRS = {  # the cases of each pair: baseline, measured, control (the baseline again)
    "run": ("a", "b", "a2"),
    "skip": ("d", "c", "d2"),
}
CHANGE_CASES = ("d", "s", "c", "x", "w", "d2")
CHANGE_RATIOS = ("s/d", "c/d", "x/d", "x/s", "w/s", "d2/d")
LABELS = {
    "b/a": "(b)/(a) hooks run vs no hooks",
    "a2/a": "(a2)/(a) control: no hooks twice",
    "c/d": "(c)/(d) skip vs built without MTP",
    "d2/d": "(d2)/(d) control: built without MTP twice",
}


def interval(ratios: list[float], resamples: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of the median of ``ratios`` (fixed seed: reruns agree)."""
    rng = random.Random(0)
    medians = sorted(
        statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples)
    )
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def paired_ratio(xs: list[float], ys: list[float]) -> dict[str, float]:
    """The median of the per-round ratios ``x / y``, with its 95% interval."""
    within = [p / q for p, q in zip(xs, ys, strict=True)]
    low, high = interval(within)
    return {"median": statistics.median(within), "low": low, "high": high}


def profiler():
    """A ``torch.profiler`` of host operators and device kernels, to enter around what it
    measures and hand to :func:`profile_summary`."""
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])


def profile_summary(prof) -> dict:
    """What ``prof`` saw: the host and device time in ms (each operator's own time, summed),
    the kernel launches, and the tables of the operators that take the most of each."""
    averages = prof.key_averages()
    return {
        "host_ms": sum(e.self_cpu_time_total for e in averages) / 1e3,
        "device_ms": sum(e.self_device_time_total for e in averages) / 1e3,
        "kernels": sum(e.count for e in averages if e.self_device_time_total > 0),
        "host": averages.table(sort_by="self_cpu_time_total", row_limit=12),
        "device": averages.table(sort_by="self_device_time_total", row_limit=12),
        "events": len(averages),
    }


def run(args) -> dict:
    import torch

    import mtp_hooks

    if args.pair == "skip":
        mtp, plain = build_models(args, True, False)
    else:
        (mtp,), plain = build_models(args, True), None
    baseline, measured_case, control = cases = PAIRS[args.pair]
    _, steps = batch_and_steps(args)
    params = {
        name: sum(p.numel() for p in model.parameters())
        for name, model in (("mtp_model", mtp), ("plain_model", plain))
        if model is not None
    }

    def once(case: str) -> tuple[float, float, float]:
        hooked = case == measured_case
        model = mtp if hooked or plain is None else plain
        handle = mtp_hooks.attach(model) if hooked else None
        if handle is not None:  # the pair names the policy: run or skip
            mtp_hooks.configure(f"train={args.pair},rollout={args.pair},eval={args.pair}")
        try:  # the steps, order and modes of gpu_mtp.py's cases
            train, fwd, ev = (ms for ms, _ in time_steps(model, steps))
        finally:
            if handle is not None:
                handle.remove()
        return train, fwd, ev

    def profile_case(case: str) -> dict:
        prof = profiler()
        with prof:
            wall = once(case)
            torch.cuda.synchronize()
        return {"wall_ms": dict(zip(TIMINGS, wall, strict=True)), **profile_summary(prof)}

    times: dict[str, dict[str, list[float]]] = {c: {t: [] for t in TIMINGS} for c in cases}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for r in range(args.warmup + args.rounds):
            shift = r % len(cases)
            for case in cases[shift:] + cases[:shift]:
                measured = once(case)
                if r >= args.warmup:
                    for t, value in zip(TIMINGS, measured, strict=True):
                        times[case][t].append(value)
            progress(r, args)
        profiles = {}
        if args.profile and torch.cuda.is_available():
            profiles = {case: profile_case(case) for case in cases}
    ratios = {}
    for x, y in ((measured_case, baseline), (control, baseline)):
        ratios[f"{x}/{y}"] = {}
        for t in TIMINGS:
            ratios[f"{x}/{y}"][t] = paired_ratio(times[x][t], times[y][t])
    return {
        "benchmark": "gpu_hooks_ab",
        "model": args.model,
        "spec": args.spec,
        "fp8": args.fp8,
        "pair": args.pair,
        "sizes": {k: getattr(args, k) for k in SIZES},
        **({"pattern": args.pattern, "experts": args.experts} if args.model == "nemotron" else {}),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "megatron_core": megatron_core_version(),
        "rounds": args.rounds,
        "warmup": args.warmup,
        "medians_ms": {c: {t: statistics.median(v) for t, v in times[c].items()} for c in cases},
        "params": params,
        "ratios": ratios,
        "profiles": profiles,
    }


def run_change(args) -> dict:
    """The ``--pair change`` cases (module docstring): train steps right after a decision
    change, against the steady state and the model built without MTP."""
    import torch

    import mtp_hooks

    mtp, plain = build_models(args, True, False)
    _, (train_step, _, _) = batch_and_steps(args)
    handle = mtp_hooks.attach(mtp)  # attached once: only the policy moves between cases
    cuda = args.device == "cuda"
    square = torch.randn(
        (2048, 2048) if cuda else (64, 64),  # a small one for --device cpu smoke runs
        device=args.device,
        dtype=torch.bfloat16 if cuda else torch.float32,
    )

    def burn(count: int) -> None:
        for _ in range(count):
            torch.mm(square, square)

    # w's burn: as many products as the run step takes longer than the skipped one
    mtp.train()
    mtp_hooks.configure("train=run")
    ran = statistics.median(timed(lambda: train_step(mtp))[0] for _ in range(3))
    mtp_hooks.configure("train=skip")
    skipped = statistics.median(timed(lambda: train_step(mtp))[0] for _ in range(3))
    product = statistics.median(timed(lambda: burn(10))[0] / 10 for _ in range(3))
    products = max(1, round((ran - skipped) / product))

    def once(case: str, timer=None) -> float:
        model = plain if case.startswith("d") else mtp
        if case == "x":
            mtp_hooks.configure("train=run")
        model.train()
        model.zero_grad(set_to_none=True)
        train_step(model)  # the step before, untimed
        if case == "w":
            burn(products)
        if case in ("c", "x"):
            mtp_hooks.configure("train=skip")
        model.zero_grad(set_to_none=True)
        if timer is not None:
            with timer:
                return timed(lambda: train_step(model))[0]
        return timed(lambda: train_step(model))[0]

    times: dict[str, list[float]] = {c: [] for c in CHANGE_CASES}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for r in range(args.warmup + args.rounds):
            shift = r % len(CHANGE_CASES)
            for case in CHANGE_CASES[shift:] + CHANGE_CASES[:shift]:
                ms = once(case)
                if r >= args.warmup:
                    times[case].append(ms)
            progress(r, args)
        profiles = {}
        if torch.cuda.is_available():
            for case in ("s", "x"):
                prof = profiler()
                once(case, prof)
                profiles[case] = profile_summary(prof)
    stats = handle.stats()["train"]  # what the gate decided: x's first steps are the runs
    handle.remove()
    ratios = {}
    for name in CHANGE_RATIOS:
        x, y = name.split("/")
        ratios[name] = paired_ratio(times[x], times[y])
    return {
        "benchmark": "gpu_hooks_ab",
        "pair": "change",
        "model": args.model,
        "spec": args.spec,
        "fp8": args.fp8,
        "sizes": {k: getattr(args, k) for k in SIZES},
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "megatron_core": megatron_core_version(),
        "rounds": args.rounds,
        "warmup": args.warmup,
        "medians_ms": {c: statistics.median(v) for c, v in times.items()},
        "ratios": ratios,
        "decisions": stats,
        "burn": {"products": products, "run_ms": ran, "skip_ms": skipped, "product_ms": product},
        "profiles": profiles,
    }


def change_table(result: dict) -> str:
    lines = [
        f"**{result['model']}**, {result['spec']} spec, {result['fp8'] or 'bf16'}, "
        f"{result['gpu']}, train steps, median of {result['rounds']} rounds (95% interval)",
        "",
        "| case | median ms |",
        "|---|---|",
        *(f"| {c} | {ms:.3f} |" for c, ms in result["medians_ms"].items()),
        "",
        "| ratio | median (95% interval) |",
        "|---|---|",
    ]
    for name, v in result["ratios"].items():
        lines.append(f"| {name} | {v['median']:.4f} ({v['low']:.4f}-{v['high']:.4f}) |")
    return "\n".join(lines)


def table(result: dict) -> str:
    lines = [
        f"**{result['model']}**, {result['spec']} spec, {result['fp8'] or 'bf16'}, "
        f"{result['gpu']}, median of {result['rounds']} rounds (95% interval)",
        "",
        "| ratio | train step | log-prob forward | eval forward |",
        "|---|---|---|---|",
    ]
    for name, per in result["ratios"].items():
        cells = [f"{v['median']:.4f} ({v['low']:.4f}-{v['high']:.4f})" for v in per.values()]
        lines.append(f"| {LABELS[name]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def progress(r: int, args: argparse.Namespace) -> None:
    """A line on stderr every tenth of the rounds, and after the warm-ups and the last round."""
    total = args.warmup + args.rounds
    if (r + 1) % max(1, total // 10) == 0 or r + 1 in (args.warmup, total):
        print(f"round {r + 1}/{total} done", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--pair", choices=[*sorted(PAIRS), "change"], default="run")
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", default=None, help="folder for the results JSON")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="run and skip pairs: profile one round of each case after the timed rounds",
    )
    args = parser.parse_args()
    check_device(args.device)
    result = run_change(args) if args.pair == "change" else run(args)
    print(json.dumps(result))
    print(change_table(result) if args.pair == "change" else table(result))
    for case, tables in result.get("profiles", {}).items():
        print(
            f"\nprofile of case {case}: host {tables['host_ms']:.2f} ms, device "
            f"{tables['device_ms']:.2f} ms, {tables['kernels']} kernel launches"
        )
        print(f"by host time:\n{tables['host']}")
        print(f"by device time:\n{tables['device']}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        suffix = "" if args.pair == "run" else f"_{args.pair}"
        name = f"gpu_hooks_ab_{args.model}_{args.spec}_{args.fp8 or 'bf16'}{suffix}.json"
        with open(os.path.join(args.out, name), "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()

"""GPU benchmark: what an attached handle whose policy says *run* costs, against no hooks.

Run on one GPU: ``python benchmarks/gpu_hooks_ab.py --model gpt|hybrid [--spec local|te]
[--fp8 delayed|tensorwise] [--rounds 150] [--out DIR]`` (model sizes as ``gpu_mtp.py``).

``gpu_mtp.py`` measures six cases in turn, so two of its cases stand a whole iteration of other
work apart; with Transformer Engine steps of 50-150 ms, the machine's jitter between them is
larger than the 0.5% that this claim is about. This benchmark measures one MTP model alone, in
three cases per round, in an order that rotates every round:

* ``a``: no hooks; ``b``: ``mtp_hooks.attach`` with ``train=run,rollout=run,eval=run``;
* ``a2``: no hooks again, the control: ``a2/a`` shows how far two identical cases read apart.

Each case runs a train step (forward + backward), a forward-only log-prob pass (``no_grad``,
phase ``rollout``) and an eval forward (``eval()``, ``no_grad``, labels). A ratio is the median
over rounds of the ratio taken within the round, with a 95% bootstrap interval of that median.
Output: a JSON line and a markdown table.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import random
import statistics
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_mtp import build, timed  # noqa: E402
from gpu_mtp_report import TIMINGS  # noqa: E402

CASES = ("a", "b", "a2")
RATIOS = (("b", "a"), ("a2", "a"))


def interval(ratios: list[float], resamples: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of the median of ``ratios`` (fixed seed: reruns agree)."""
    rng = random.Random(0)
    medians = sorted(
        statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples)
    )
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def run(args) -> dict:
    import torch

    import mtp_hooks
    from mtp_hooks.demo import tiny_models

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tiny_models.init_single_process()
        tiny_models.reset_mtp_loss_tracker(device=args.device)
        model = build(args.model, True, args)
    os.environ["MTP_HOOKS_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    ids = torch.randint(0, args.vocab, (1, args.seq), device=args.device)
    pos = torch.arange(args.seq, device=args.device).unsqueeze(0)
    labels = torch.roll(ids, -1, dims=1)

    def once(hooked: bool) -> tuple[float, float, float]:
        handle = mtp_hooks.attach(model) if hooked else None
        if handle is not None:
            mtp_hooks.configure("train=run,rollout=run,eval=run")
        try:
            model.train()
            model.zero_grad(set_to_none=True)
            train, _ = timed(lambda: model(ids, pos, None, labels=labels).float().mean().backward())
            model.zero_grad(set_to_none=True)
            with torch.no_grad(), mtp_hooks.phase("rollout"):
                fwd, _ = timed(lambda: model(ids, pos, None))
            model.eval()
            with torch.no_grad():
                ev, _ = timed(lambda: model(ids, pos, None, labels=labels))
        finally:
            if handle is not None:
                handle.remove()
        return train, fwd, ev

    times: dict[str, dict[str, list[float]]] = {c: {t: [] for t in TIMINGS} for c in CASES}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for r in range(args.warmup + args.rounds):
            shift = r % len(CASES)
            for case in CASES[shift:] + CASES[:shift]:
                measured = once(hooked=case == "b")
                if r >= args.warmup:
                    for t, value in zip(TIMINGS, measured, strict=True):
                        times[case][t].append(value)
    ratios = {}
    for x, y in RATIOS:
        ratios[f"{x}/{y}"] = {}
        for t in TIMINGS:
            within = [p / q for p, q in zip(times[x][t], times[y][t], strict=True)]
            low, high = interval(within)
            ratios[f"{x}/{y}"][t] = {"median": statistics.median(within), "low": low, "high": high}
    return {
        "benchmark": "gpu_hooks_ab",
        "model": args.model,
        "spec": args.spec,
        "fp8": args.fp8,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "megatron_core": importlib.metadata.version("megatron-core"),
        "rounds": args.rounds,
        "warmup": args.warmup,
        "medians_ms": {c: {t: statistics.median(v) for t, v in times[c].items()} for c in CASES},
        "ratios": ratios,
    }


def table(result: dict) -> str:
    label = {"b/a": "(b)/(a) hooks run vs no hooks", "a2/a": "(a2)/(a) control: no hooks twice"}
    lines = [
        f"**{result['model']}**, {result['spec']} spec, {result['fp8'] or 'bf16'}, "
        f"{result['gpu']}, median of {result['rounds']} rounds (95% interval)",
        "",
        "| ratio | train step | log-prob forward | eval forward |",
        "|---|---|---|---|",
    ]
    for name, per in result["ratios"].items():
        cells = [f"{v['median']:.4f} ({v['low']:.4f}-{v['high']:.4f})" for v in per.values()]
        lines.append(f"| {label[name]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["gpt", "hybrid"], default="gpt")
    parser.add_argument("--spec", choices=["local", "te"], default="local")
    parser.add_argument("--fp8", choices=["delayed", "tensorwise"], default=None)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=14336)
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", default="cuda", help="cuda; cpu only for a smoke run")
    parser.add_argument("--out", default=None, help="folder for the results JSON")
    args = parser.parse_args()
    args.attention = "local" if args.device == "cuda" else "sdpa"
    result = run(args)
    print(json.dumps(result))
    print(table(result))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        name = f"gpu_hooks_ab_{result['model']}_{result['spec']}_{result['fp8'] or 'bf16'}.json"
        with open(os.path.join(args.out, name), "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()

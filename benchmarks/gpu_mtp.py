"""GPU benchmark: skipping MTP through mtp-hooks against a model built without MTP.

Run on one GPU: ``python benchmarks/gpu_mtp.py --model gpt|hybrid [--out DIR]``.

Four cases, measured round-robin in one process so drift hits all of them alike:

(a) the MTP model, no hooks; (b) hooks attached, policy run; (c) hooks attached, policy skip;
(d) the same architecture built without MTP.

Each case does a train step (forward + backward) and a forward-only log-prob pass
(``no_grad``, no labels, phase ``rollout``); it reports the median, min and max time and the
peak extra memory. Output: a JSON line, a markdown table with the ratios (c)/(d) and (b)/(a),
and, where matplotlib is importable, a PNG bar chart (``--plot results.json`` draws it later).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = ("a_mtp_no_hooks", "b_hooks_run", "c_hooks_skip", "d_built_without_mtp")
LABELS = {
    "a_mtp_no_hooks": "(a) MTP model, no hooks",
    "b_hooks_run": "(b) hooks, policy run",
    "c_hooks_skip": "(c) hooks, policy skip",
    "d_built_without_mtp": "(d) built without MTP",
}


def build(kind: str, mtp: bool, args):
    import torch

    from mtp_hooks import tiny_models

    spec = tiny_models.TinySpec(
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=args.ffn,
        vocab_size=args.vocab,
        seq_length=args.seq,
        mtp_num_layers=1 if mtp else None,
        swiglu=True,
        rmsnorm=True,
        bias=False,
        params_dtype=torch.bfloat16,
    )
    torch.manual_seed(0)
    if kind == "gpt":
        model = tiny_models.build_gpt(spec, attention=args.attention)
    else:
        pattern = "*-" * args.layers + ("/*-" if mtp else "")
        model = tiny_models.build_hybrid(spec, attention=args.attention, pattern=pattern)
    return model.to(device=args.device, dtype=torch.bfloat16)  # as Float16Module does


def timed(fn) -> tuple[float, float]:
    """Run ``fn`` once; return (milliseconds, peak extra GiB above the memory held before)."""
    import torch

    if not torch.cuda.is_available():  # --device cpu smoke runs: time only
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3, 0.0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1e3
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**30


def run(args) -> dict:
    import torch

    import mtp_hooks
    from mtp_hooks import tiny_models

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tiny_models.init_single_process()
        tiny_models.reset_mtp_loss_tracker(device=args.device)
        mtp_model = build(args.model, True, args)
        plain_model = build(args.model, False, args)
    os.environ["MTP_HOOKS_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    params = {
        "mtp_model_params": sum(p.numel() for p in mtp_model.parameters()),
        "mtp_params": sum(p.numel() for p in mtp_model.mtp.parameters()),
        "plain_model_params": sum(p.numel() for p in plain_model.parameters()),
    }
    ids = torch.randint(0, args.vocab, (1, args.seq), device=args.device)
    pos = torch.arange(args.seq, device=args.device).unsqueeze(0)
    labels = torch.roll(ids, -1, dims=1)

    def train_step(model):
        model.zero_grad(set_to_none=True)
        model(ids, pos, None, labels=labels).float().mean().backward()

    def logprob(model):
        with torch.no_grad():
            model(ids, pos, None)

    state = {"handle": None}

    def setup(case):
        if state["handle"] is not None:
            state["handle"].remove()
            state["handle"] = None
        if case in ("b_hooks_run", "c_hooks_skip"):
            state["handle"] = mtp_hooks.attach(mtp_model)
            policy = "run" if case == "b_hooks_run" else "skip"
            mtp_hooks.configure(f"train={policy},rollout={policy}")
        return plain_model if case == "d_built_without_mtp" else mtp_model

    results: dict[str, dict[str, list[float]]] = {
        c: {"train_ms": [], "train_gib": [], "fwd_ms": [], "fwd_gib": []} for c in CASES
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for it in range(args.warmup + args.iters):
            for case in CASES:
                model = setup(case)
                model.train()
                t_ms, t_gib = timed(lambda m=model: train_step(m))
                model.zero_grad(set_to_none=True)
                with mtp_hooks.phase("rollout"):
                    f_ms, f_gib = timed(lambda m=model: logprob(m))
                if it >= args.warmup:
                    r = results[case]
                    r["train_ms"].append(t_ms)
                    r["train_gib"].append(t_gib)
                    r["fwd_ms"].append(f_ms)
                    r["fwd_gib"].append(f_gib)
            print(
                f"iteration {it + 1}/{args.warmup + args.iters} done", file=sys.stderr, flush=True
            )
    setup(None)
    summary = {}
    for case, r in results.items():
        summary[case] = {
            "train_ms_median": statistics.median(r["train_ms"]),
            "train_ms_min": min(r["train_ms"]),
            "train_ms_max": max(r["train_ms"]),
            "train_peak_extra_gib": max(r["train_gib"]),
            "fwd_ms_median": statistics.median(r["fwd_ms"]),
            "fwd_ms_min": min(r["fwd_ms"]),
            "fwd_ms_max": max(r["fwd_ms"]),
            "fwd_peak_extra_gib": max(r["fwd_gib"]),
        }
    return {
        "benchmark": "gpu_mtp",
        "model": args.model,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "megatron_core": importlib.metadata.version("megatron-core"),
        "iters": args.iters,
        "warmup": args.warmup,
        "sizes": {k: getattr(args, k) for k in ("hidden", "layers", "ffn", "vocab", "seq")},
        **params,
        "cases": summary,
    }


def table(result: dict) -> str:
    cases = result["cases"]
    lines = [
        f"**{result['model']}** on {result['gpu']}, megatron-core {result['megatron_core']}, "
        f"{result['mtp_model_params'] / 1e9:.2f}B params "
        f"({result['mtp_params'] / 1e9:.2f}B in MTP); "
        f"median of {result['iters']} after {result['warmup']} warm-ups, cases interleaved.",
        "",
        "| case | train step median (min-max) | forward only median (min-max) "
        "| peak extra mem, train | peak extra mem, forward |",
        "|---|---|---|---|---|",
    ]
    for case in CASES:
        c = cases[case]
        lines.append(
            f"| {LABELS[case]} | {c['train_ms_median']:.1f} ms "
            f"({c['train_ms_min']:.1f}-{c['train_ms_max']:.1f}) "
            f"| {c['fwd_ms_median']:.1f} ms ({c['fwd_ms_min']:.1f}-{c['fwd_ms_max']:.1f}) "
            f"| {c['train_peak_extra_gib']:.2f} GiB | {c['fwd_peak_extra_gib']:.2f} GiB |"
        )
    a, b, c_, d = (cases[k] for k in CASES)

    def ratio(x, y, key):
        return f"{x[key] / y[key]:.4f}" if y[key] else "n/a"

    lines += [
        "",
        "| ratio | train time | forward time | train memory | goal |",
        "|---|---|---|---|---|",
        f"| (c)/(d) skip vs built without MTP | {ratio(c_, d, 'train_ms_median')} | "
        f"{ratio(c_, d, 'fwd_ms_median')} | {ratio(c_, d, 'train_peak_extra_gib')} | within 1% |",
        f"| (b)/(a) hooks run vs no hooks | {ratio(b, a, 'train_ms_median')} | "
        f"{ratio(b, a, 'fwd_ms_median')} | {ratio(b, a, 'train_peak_extra_gib')} | within 0.5% |",
        f"| (c)/(a) skip vs MTP run | {ratio(c_, a, 'train_ms_median')} | "
        f"{ratio(c_, a, 'fwd_ms_median')} | {ratio(c_, a, 'train_peak_extra_gib')} | saving |",
    ]
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, result in zip(axes[0], results, strict=True):
        cases = result["cases"]
        x = range(len(CASES))
        train = [cases[c]["train_ms_median"] for c in CASES]
        fwd = [cases[c]["fwd_ms_median"] for c in CASES]
        ax.bar([i - 0.2 for i in x], train, width=0.4, label="train step")
        ax.bar([i + 0.2 for i in x], fwd, width=0.4, label="forward only")
        ax.set_xticks(list(x), [LABELS[c].split(") ")[0] + ")" for c in CASES])
        ax.set_ylabel("median ms")
        ax.set_title(f"{result['model']}: {result['mtp_model_params'] / 1e9:.2f}B, {result['gpu']}")
        ax.legend()
    fig.suptitle("(a) MTP, no hooks  (b) hooks run  (c) hooks skip  (d) built without MTP")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["gpt", "hybrid"], default="gpt")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=14336)
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda", help="cuda; cpu only for a smoke run")
    parser.add_argument("--out", default=None, help="folder for results JSON and chart")
    parser.add_argument("--plot", nargs="+", default=None, help="draw a chart from result JSONs")
    args = parser.parse_args()
    args.attention = "local" if args.device == "cuda" else "sdpa"  # local needs a CUDA buffer
    if args.plot:
        results = [json.loads(open(p).read()) for p in args.plot]
        plot(results, args.out or "gpu_mtp.png")
        return
    result = run(args)
    print(json.dumps(result))
    print(table(result))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"gpu_mtp_{args.model}.json"), "w") as fh:
            json.dump(result, fh, indent=2)
        try:
            plot([result], os.path.join(args.out, f"gpu_mtp_{args.model}.png"))
        except ImportError:
            print("matplotlib not installed: no chart (use --plot later)", file=sys.stderr)


if __name__ == "__main__":
    main()

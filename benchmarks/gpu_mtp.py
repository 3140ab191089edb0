"""GPU benchmark: skipping MTP through mtp-hooks against a model built without MTP.

Run on one GPU: ``python benchmarks/gpu_mtp.py --model gpt|hybrid [--spec local|te]
[--fp8 delayed|tensorwise] [--out DIR]``. ``--spec te`` builds megatron's Transformer Engine
layer specs (the default of Megatron-LM's ``pretrain_gpt.py``); ``--fp8`` trains and runs them in
FP8 with that recipe (``fp8="hybrid"``).

Six cases, measured round-robin in one process so drift hits all of them alike:

(a) the MTP model, no hooks; (b) hooks attached, policy run; (c) hooks attached, policy skip;
(d) the same architecture built without MTP; (e) hooks attached, policy run, and
``eval=run+metrics``: the eval forward also records MTP loss and acceptance; (f) hooks attached,
``train=run+detach``: MTP trains on detached inputs, its loss reaching only the MTP weights.

Each case does a train step (forward + backward), a forward-only log-prob pass (``no_grad``,
no labels, phase ``rollout``) and an eval forward (``eval()``, ``no_grad``, labels); it reports
the median, min and max time and the peak extra memory. The cost of (e)'s metrics is set
against one output-layer projection with its cross-entropy and top-1, timed on its own.
Output: a JSON line, a markdown table with the ratios, and, where matplotlib is importable, a
PNG bar chart (``--plot results.json`` draws it later).
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_mtp_report import CASES, PAIRS, TIMINGS, plot, stem, table  # noqa: E402

SIZES = ("hidden", "layers", "ffn", "vocab", "seq", "batch", "topk")
"""The sizes a result records (``topk`` is read by the Nemotron-3-shaped model alone)."""


def build(kind: str, mtp: bool, args):
    import torch

    from mtp_hooks.demo import nemotron_models, tiny_models

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
    impl = {"attention": args.attention}
    if args.spec == "te":
        impl = {"transformer_impl": "transformer_engine"}
    if args.fp8:
        impl.update(fp8="hybrid", fp8_recipe=args.fp8)
    torch.manual_seed(0)
    if kind == "gpt":
        model = tiny_models.build_gpt(spec, **impl)
    elif kind == "nemotron":
        pattern = args.pattern if mtp else args.pattern.split("/")[0]
        model = nemotron_models.build_nemotron(
            spec,
            pattern=pattern,
            num_experts=args.experts,
            topk=args.topk,
            expert_bias=args.device == "cuda",  # megatron allocates the bias on a CUDA device
            deterministic_mode=args.deterministic,
            **impl,
            moe_ffn_hidden_size=args.ffn,
        )
    else:
        pattern = "*-" * args.layers + ("/*-" if mtp else "")
        model = tiny_models.build_hybrid(spec, pattern=pattern, **impl)
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


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, its layer spec and sizes, and the device: shared with ``gpu_hooks_ab.py``."""
    parser.add_argument("--model", choices=["gpt", "hybrid", "nemotron"], default="gpt")
    parser.add_argument(
        "--pattern",
        default="M*MEME/*E/*E",
        help="nemotron: the hybrid layer pattern, MTP depths after each '/'",
    )
    parser.add_argument("--experts", type=int, default=8, help="nemotron: MoE experts")
    parser.add_argument("--topk", type=int, default=2, help="nemotron: experts per token")
    parser.add_argument(
        "--deterministic", action="store_true", help="nemotron: megatron's deterministic_mode"
    )
    parser.add_argument("--spec", choices=["local", "te"], default="local")
    parser.add_argument("--fp8", choices=["delayed", "tensorwise"], default=None)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=14336)
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1, help="sequences per batch")
    parser.add_argument("--device", default="cuda", help="cuda; cpu only for a smoke run")


def megatron_core_version() -> str:
    """The megatron-core in use: its distribution's version, or, where it runs from a source
    tree on ``PYTHONPATH`` (the megatron_rl benchmark's pinned trees), the tree's own."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        from megatron.core import package_info

        return f"{package_info.__version__} (source tree)"


def check_device(device: str) -> None:
    """Stop with one line naming the fix where ``device`` is CUDA and this machine has none."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        sys.exit(
            "gpu_mtp: no CUDA GPU is visible here (torch.cuda.is_available() is False). Run it "
            "on a GPU machine, or pass --device cpu for a smoke run whose timings mean nothing."
        )


def build_models(args, *with_mtp: bool) -> list:
    """One rank of megatron, a zeroed MTP loss tracker, and a model per ``with_mtp`` flag;
    plugins from entry points stay out of the measurement."""
    from mtp_hooks.demo import tiny_models

    args.attention = "local" if args.device == "cuda" else "sdpa"  # local needs a CUDA buffer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tiny_models.init_single_process()
        depths = args.pattern.count("/") if args.model == "nemotron" else 1
        tiny_models.reset_mtp_loss_tracker(num_layers=depths, device=args.device)
        models = [build(args.model, mtp, args) for mtp in with_mtp]
    os.environ["MTP_HOOKS_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return models


def batch_and_steps(args) -> tuple:
    """One batch's labels, and the three steps timed for every case, each given the model: a
    train step, a log-prob forward and an eval forward. They neither set the model's mode nor
    clear its gradients: ``time_steps`` does that outside the timing."""
    import torch

    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device)
    pos = torch.arange(args.seq, device=args.device).unsqueeze(0).expand(args.batch, -1)
    labels = torch.roll(ids, -1, dims=1)

    def train_step(model):
        model(ids, pos, None, labels=labels).float().mean().backward()

    def logprob(model):
        with torch.no_grad():
            model(ids, pos, None)

    def eval_forward(model):
        with torch.no_grad():
            model(ids, pos, None, labels=labels)

    return labels, (train_step, logprob, eval_forward)


def time_steps(model, steps) -> tuple[tuple[float, float], ...]:
    """``timed`` results of ``steps`` (from ``batch_and_steps``) on ``model``, in the order and
    modes of every case: the train step in training mode, the log-prob forward in phase
    ``rollout``, the eval forward in ``eval()`` mode. Modes are set and gradients cleared here,
    outside the timing: ``train()``, ``eval()`` and ``zero_grad()`` walk every module or
    parameter, so inside it the MTP model, with more of them, would pay more than the model
    built without MTP on every timed step."""
    import mtp_hooks

    train_step, logprob, eval_forward = steps
    model.train()
    model.zero_grad(set_to_none=True)
    train = timed(lambda: train_step(model))
    model.zero_grad(set_to_none=True)
    with mtp_hooks.phase("rollout"):
        fwd = timed(lambda: logprob(model))
    model.eval()
    return train, fwd, timed(lambda: eval_forward(model))


def run(args) -> dict:
    import torch

    import mtp_hooks

    mtp_model, plain_model = build_models(args, True, False)
    if "mtp_detach_heads" in type(mtp_model.config).__dataclass_fields__:  # case f detaches
        mtp_hooks.megatron.clip_mtp_apart(mtp_model)
    params = {
        "mtp_model_params": sum(p.numel() for p in mtp_model.parameters()),
        "mtp_params": sum(p.numel() for p in mtp_model.mtp.parameters()),
        "plain_model_params": sum(p.numel() for p in plain_model.parameters()),
    }
    labels, steps = batch_and_steps(args)
    state = {"handle": None}

    def setup(case):
        if state["handle"] is not None:
            state["handle"].remove()
            state["handle"] = None
        if case in ("b_hooks_run", "c_hooks_skip", "e_run_metrics", "f_run_detach"):
            state["handle"] = mtp_hooks.attach(mtp_model)
            policy = "skip" if case == "c_hooks_skip" else "run"
            metrics = "+metrics" if case == "e_run_metrics" else ""
            detach = "+detach" if case == "f_run_detach" else ""
            mtp_hooks.configure(f"train={policy}{detach},rollout={policy},eval={policy}{metrics}")
        return plain_model if case == "d_built_without_mtp" else mtp_model

    results: dict[str, dict[str, list[float]]] = {
        c: {f"{t}_{unit}": [] for t in TIMINGS for unit in ("ms", "gib")} for c in CASES
    }
    recorded = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for it in range(args.warmup + args.iters):
            for case in CASES:
                model = setup(case)
                (t_ms, t_gib), (f_ms, f_gib), (e_ms, e_gib) = time_steps(model, steps)
                if case == "e_run_metrics":
                    recorded.append(state["handle"].metrics(reset=True)["eval"])
                if it >= args.warmup:
                    r = results[case]
                    for name, value in zip(r, (t_ms, t_gib, f_ms, f_gib, e_ms, e_gib), strict=True):
                        r[name].append(value)
            print(
                f"iteration {it + 1}/{args.warmup + args.iters} done", file=sys.stderr, flush=True
            )
    setup(None)
    summary = {}
    for case, r in results.items():
        summary[case] = {}
        for t in TIMINGS:
            summary[case].update(
                {
                    f"{t}_ms_median": statistics.median(r[f"{t}_ms"]),
                    f"{t}_ms_min": min(r[f"{t}_ms"]),
                    f"{t}_ms_max": max(r[f"{t}_ms"]),
                    f"{t}_peak_extra_gib": max(r[f"{t}_gib"]),
                }
            )
    projection = projection_ms(mtp_model, labels, args)
    paired = {  # median over iterations of the ratio within the iteration: drift cancels
        f"{x}/{y}": {
            t: statistics.median(
                p / q for p, q in zip(results[x][f"{t}_ms"], results[y][f"{t}_ms"], strict=True)
            )
            for t in TIMINGS
        }
        for x, y in PAIRS
    }
    return {
        "benchmark": "gpu_mtp",
        "model": args.model,
        "spec": args.spec,
        "fp8": args.fp8,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "megatron_core": megatron_core_version(),
        "iters": args.iters,
        "warmup": args.warmup,
        "sizes": {k: getattr(args, k) for k in SIZES},
        **({"pattern": args.pattern, "experts": args.experts} if args.model == "nemotron" else {}),
        **params,
        "cases": summary,
        "paired_ratios": paired,
        "projection_ms_median": projection,
        "recorded_metrics": {"loss": recorded[-1].loss, "acceptance": recorded[-1].acceptance},
    }


def projection_ms(model, labels, args) -> float:
    """Median time of what a recorded forward adds per MTP depth, on its own: the output-layer
    projection of one MTP chunk, its vocab-parallel cross-entropy and the top-1."""
    import torch

    hidden = torch.randn(
        args.seq, args.batch, args.hidden, device=args.device, dtype=torch.bfloat16
    )

    def once():
        logits, _ = model.output_layer(hidden)
        model.compute_language_model_loss(labels, logits).sum()
        logits.argmax(-1)

    with torch.no_grad():
        times = [timed(once)[0] for _ in range(args.warmup + args.iters)]
    return statistics.median(times[args.warmup :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=None, help="folder for results JSON and chart")
    parser.add_argument("--plot", nargs="+", default=None, help="draw a chart from result JSONs")
    args = parser.parse_args()
    if args.plot:
        results = [json.loads(open(p).read()) for p in args.plot]
        plot(results, args.out or "gpu_mtp.png")
        return
    check_device(args.device)
    result = run(args)
    print(json.dumps(result))
    print(table(result))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"{stem(result)}.json"), "w") as fh:
            json.dump(result, fh, indent=2)
        try:
            plot([result], os.path.join(args.out, f"{stem(result)}.png"))
        except ImportError:
            print("matplotlib not installed: no chart (use --plot later)", file=sys.stderr)


if __name__ == "__main__":
    main()

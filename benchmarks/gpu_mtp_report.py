"""The report of ``benchmarks/gpu_mtp.py``: its cases, the markdown table with the ratios and
goals, the file names and the bar chart."""

from __future__ import annotations

CASES = (
    "a_mtp_no_hooks",
    "b_hooks_run",
    "c_hooks_skip",
    "d_built_without_mtp",
    "e_run_metrics",
    "f_run_detach",
)
LABELS = {
    "a_mtp_no_hooks": "(a) MTP model, no hooks",
    "b_hooks_run": "(b) hooks, policy run",
    "c_hooks_skip": "(c) hooks, policy skip",
    "d_built_without_mtp": "(d) built without MTP",
    "e_run_metrics": "(e) hooks, run, eval +metrics",
    "f_run_detach": "(f) hooks, train run+detach",
}
# The same cases, in the few words that fit under a chart's bars.
TICKS = {
    "a_mtp_no_hooks": "(a)\nMTP model,\nno hooks",
    "b_hooks_run": "(b)\nhooks,\nrun",
    "c_hooks_skip": "(c)\nhooks,\nskip",
    "d_built_without_mtp": "(d)\nbuilt\nwithout MTP",
    "e_run_metrics": "(e)\nrun, eval\n+metrics",
    "f_run_detach": "(f)\ntrain\nrun+detach",
}
TIMINGS = ("train", "fwd", "eval")
# The ratios reported, as (case, reference case): keys of a result's "paired_ratios".
PAIRS = (
    ("c_hooks_skip", "d_built_without_mtp"),
    ("b_hooks_run", "a_mtp_no_hooks"),
    ("c_hooks_skip", "a_mtp_no_hooks"),
    ("e_run_metrics", "a_mtp_no_hooks"),
    ("f_run_detach", "a_mtp_no_hooks"),
    ("f_run_detach", "c_hooks_skip"),
)


def table(result: dict) -> str:
    cases = result["cases"]
    lines = [
        f"**{result['model']}**, {_precision(result)}, on {result['gpu']}, "
        f"megatron-core {result['megatron_core']}, "
        f"{result['mtp_model_params'] / 1e9:.2f}B params "
        f"({result['mtp_params'] / 1e9:.2f}B in MTP); "
        f"median of {result['iters']} after {result['warmup']} warm-ups, cases interleaved.",
        "",
        "| case | train step median (min-max) | log-prob forward median (min-max) "
        "| eval forward median (min-max) | peak extra mem, train | peak extra mem, eval |",
        "|---|---|---|---|---|---|",
    ]
    for case in (c for c in CASES if c in cases):  # results from before (f) have no (f)
        c = cases[case]
        cells = [
            f"{c[f'{t}_ms_median']:.1f} ms ({c[f'{t}_ms_min']:.1f}-{c[f'{t}_ms_max']:.1f})"
            for t in TIMINGS
        ]
        lines.append(
            f"| {LABELS[case]} | {' | '.join(cells)} "
            f"| {c['train_peak_extra_gib']:.2f} GiB | {c['eval_peak_extra_gib']:.2f} GiB |"
        )
    a, b, c_, d, e = (cases[k] for k in CASES[:5])
    f = cases.get("f_run_detach")

    def ratio(x, y, key):
        return f"{x[key] / y[key]:.4f}" if y[key] else "n/a"

    extra = e["eval_ms_median"] - a["eval_ms_median"]
    lines += [
        "",
        "| ratio | train time | log-prob time | eval time | train memory | goal |",
        "|---|---|---|---|---|---|",
    ]
    paired = result.get("paired_ratios", {})
    for (label, x, y, goal), key in zip(
        (
            ("(c)/(d) skip vs built without MTP", c_, d, "within 1%"),
            ("(b)/(a) hooks run vs no hooks", b, a, "within 0.5%"),
            ("(c)/(a) skip vs MTP run", c_, a, "saving"),
            ("(e)/(a) eval +metrics vs no hooks", e, a, "eval: one projection per depth"),
            ("(f)/(a) train run+detach vs no hooks", f, a, "train: about (a)"),
            ("(f)/(c) train run+detach vs skip", f, c_, "train: the cost of training MTP"),
        ),
        (f"{x}/{y}" for x, y in PAIRS),
        strict=True,
    ):
        if x is None:
            continue
        times = " | ".join(ratio(x, y, f"{t}_ms_median") for t in TIMINGS)
        lines.append(f"| {label} | {times} | {ratio(x, y, 'train_peak_extra_gib')} | {goal} |")
        if key in paired:  # results from before paired ratios were recorded have none
            cells = " | ".join(f"{paired[key][t]:.4f}" for t in TIMINGS)
            lines.append(f"| {label}, paired per iteration | {cells} | | |")
    lines += [
        "",
        f"Metrics cost: (e) - (a) eval forward = {extra:.2f} ms; one output-layer projection with "
        f"its cross-entropy and top-1, timed alone: {result['projection_ms_median']:.2f} ms "
        f"(ratio {extra / result['projection_ms_median']:.2f}; MTP depth 1). Recorded: "
        f"loss {result['recorded_metrics']['loss'][0]:.3f}, "
        f"acceptance {result['recorded_metrics']['acceptance'][0]:.4f}.",
    ]
    return "\n".join(lines)


def _precision(result: dict) -> str:
    """How the benchmarked model was built: layer spec and precision."""
    spec = "TE layer specs" if result.get("spec") == "te" else "local layer specs"
    fp8 = result.get("fp8")
    return f"{spec}, " + (f"FP8 {fp8} recipe" if fp8 else "bf16")


def stem(result: dict) -> str:
    """The results file name: gpu_mtp_<model>[_h<hidden>][_te][_<fp8 recipe>]."""
    parts = [f"gpu_mtp_{result['model']}"]
    if result["model"] == "nemotron":  # measured at several sizes
        parts.append(f"h{result['sizes']['hidden']}")
    if result.get("spec") == "te":
        parts.append("te")
    if result.get("fp8"):
        parts.append(result["fp8"])
    return "_".join(parts)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Each case is named under its own bars, in lines short enough for a panel 6 inches wide:
    # a one-line legend of all six ran past the figure's edges and was cut.
    ticks = [TICKS[c] for c in CASES]
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.4), squeeze=False)
    for ax, result in zip(axes[0], results, strict=True):
        cases = result["cases"]
        x = range(len(CASES))
        train = [cases[c]["train_ms_median"] for c in CASES]
        fwd = [cases[c]["fwd_ms_median"] for c in CASES]
        ax.bar([i - 0.2 for i in x], train, width=0.4, label="train step")
        ax.bar([i + 0.2 for i in x], fwd, width=0.4, label="forward only")
        ax.set_xticks(list(x), ticks, fontsize=8.5)
        ax.set_ylabel("median ms")
        ax.set_title(
            f"{result['model']} ({_precision(result)}): "
            f"{result['mtp_model_params'] / 1e9:.2f}B, {result['gpu']}",
            fontsize=10,
        )
        ax.legend(loc="lower left", fontsize=8.5)
    fig.tight_layout()
    fig.savefig(path, dpi=120)

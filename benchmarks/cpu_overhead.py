"""CPU overhead of mtp-hooks: ``decide()`` and the per-forward hook cost, run and skip paths.

Run: ``python benchmarks/cpu_overhead.py`` (prints a JSON line and a markdown table).

* ``decide()``: a config that answers plus two registered plugins (the config short-circuits
  them, as in production), and a no-config case where both plugins vote.
* hook pair: the pre-hook and forward hook an attached handle adds to each forward, called on a
  real tiny ``GPTModel`` exactly as ``nn.Module.__call__`` calls them, for a run and a skip.
* end to end: a tiny ``GPTModel`` forward without hooks vs attached, interleaved; the
  difference is within noise at this size and is shown for context only.

Figures are medians of repeated batches (``timeit``), on whatever CPU runs the script.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import timeit
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mtp_hooks  # noqa: E402


def median_us(fn, number: int, repeat: int = 15) -> float:
    times = timeit.repeat(fn, number=number, repeat=repeat)
    return statistics.median(times) / number * 1e6


class Vote:
    def __init__(self, vote):
        self.vote = vote

    @mtp_hooks.hookimpl
    def should_run_mtp(self, model, phase):
        return self.vote


def bench_decide() -> dict[str, float]:
    mtp_hooks.reset()
    os.environ["MTP_HOOKS_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    mtp_hooks.register(Vote(None), name="abstains")
    mtp_hooks.register(Vote(False), name="skips-eval")
    no_config = median_us(lambda: mtp_hooks.decide(None, "eval"), 20000)
    mtp_hooks.configure("train=run,eval=skip,rollout=skip")
    with_config = median_us(lambda: mtp_hooks.decide(None, "eval"), 20000)
    mtp_hooks.reset()
    return {"decide_config_2_plugins_us": with_config, "decide_votes_2_plugins_us": no_config}


def bench_hooks() -> dict[str, float]:
    import torch

    from mtp_hooks import tiny_models

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tiny_models.init_single_process(port=tiny_models.free_port())
        tiny_models.reset_mtp_loss_tracker()
        torch.manual_seed(0)
        model = tiny_models.build_gpt(attention="sdpa")
    mtp_hooks.reset()
    os.environ["MTP_HOOKS_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    handle = mtp_hooks.attach(model)
    (gate,) = handle.gates
    ids = torch.randint(0, 128, (2, 16))
    pos = torch.arange(16).unsqueeze(0).expand(2, -1)
    args, kwargs = (ids, pos, None), {"labels": ids}
    out = torch.zeros(2, 16)

    def hook_pair() -> None:
        result = gate.pre_hook(model, args, kwargs)
        a, k = result if result is not None else (args, kwargs)
        gate.post_hook(model, a, k, out)

    figures = {}
    for policy in ("train=run", "train=skip"):
        mtp_hooks.configure(policy)
        figures[f"hook_pair_{policy.split('=')[1]}_us"] = median_us(hook_pair, 20000)

    # What nn.Module.__call__ itself adds when a module has these two hooks (no-op hooks).
    class Identity(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return args[0]

    bare, hooked = Identity(), Identity()
    hooked.register_forward_pre_hook(lambda m, a, k: None, with_kwargs=True, prepend=True)
    hooked.register_forward_hook(lambda m, a, k, o: None, with_kwargs=True, always_call=True)
    figures["torch_dispatch_us"] = median_us(lambda: hooked(*args, **kwargs), 20000) - median_us(
        lambda: bare(*args, **kwargs), 20000
    )
    for path in ("run", "skip"):
        figures[f"added_per_forward_{path}_us"] = (
            figures[f"hook_pair_{path}_us"] + figures["torch_dispatch_us"]
        )

    # End to end, interleaved: forward without hooks vs attached (run path).
    mtp_hooks.configure("train=run")
    with_hooks, without = [], []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(30):
            with_hooks.append(
                min(timeit.repeat(lambda: model(*args, **kwargs), number=5, repeat=3)) / 5
            )
            handle.remove()
            without.append(
                min(timeit.repeat(lambda: model(*args, **kwargs), number=5, repeat=3)) / 5
            )
            handle = mtp_hooks.attach(model)
    figures["forward_without_hooks_ms"] = statistics.median(without) * 1e3
    figures["forward_attached_run_ms"] = statistics.median(with_hooks) * 1e3
    handle.remove()
    mtp_hooks.reset()
    return figures


def main() -> dict[str, float]:
    figures = {**bench_decide(), **bench_hooks()}
    meta = {
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
    }
    print(
        json.dumps(
            {"benchmark": "cpu_overhead", **meta, **{k: round(v, 3) for k, v in figures.items()}}
        )
    )
    print()
    print("| measure | median |")
    print("|---|---|")
    labels = {
        "decide_config_2_plugins_us": "`decide()`, config answers, 2 plugins registered",
        "decide_votes_2_plugins_us": "`decide()`, no config, 2 plugins vote",
        "hook_pair_run_us": "hook pair per forward, run path",
        "hook_pair_skip_us": "hook pair per forward, skip path (gates toggled and restored)",
        "torch_dispatch_us": "nn.Module.__call__ cost of having two hooks (no-op hooks)",
        "added_per_forward_run_us": "**added cost per forward, run path** (pair + dispatch)",
        "added_per_forward_skip_us": "**added cost per forward, skip path** (pair + dispatch)",
        "forward_without_hooks_ms": "tiny GPTModel forward, no hooks",
        "forward_attached_run_ms": "tiny GPTModel forward, attached, run",
    }
    for key, label in labels.items():
        unit = "ms" if key.endswith("_ms") else "µs"
        print(f"| {label} | {figures[key]:.2f} {unit} |")
    return figures


if __name__ == "__main__":
    main()

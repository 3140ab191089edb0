"""CPU overhead of mtp-hooks per forward, as ratios to what torch itself charges for two hooks.

Run: ``python benchmarks/cpu_overhead.py [--runs 3] [--rounds 150] [--calls 400]``; it prints a
JSON line per run and a markdown table.

Every case calls a module whose ``forward`` returns its input, through ``nn.Module.__call__``,
so the figures are the hooks' cost and nothing else. The cases run interleaved (the order
rotates each round), each round times every case for ``--calls`` calls:

* ``bare``: no hooks. ``noop``: two no-op hooks registered as the gate registers its own
  (a kwargs pre-hook, prepended; a kwargs ``always_call`` forward hook). ``noop - bare`` is the
  floor, ``torch_dispatch_us``: what torch charges for having two hooks at all.
* ``run`` / ``skip``: the real gate of an attached tiny ``GPTModel``, its two hooks registered
  on the trivial module (which carries the model's ``mtp_process`` and ``config``), with a
  policy config that answers ``run`` or ``skip``.
* ``vote`` / ``cached_vote``: the same gate with no config and one plugin that votes *run*,
  asked at every forward, or declared ``cacheable_vote``.
* ``auto_plain``: a plain module built while auto-attach is on (it gets no hook).

Each ratio is the median over rounds of ``(case - bare) / (noop - bare)`` within the round, so a
slow stretch of the machine scales both terms alike. ``decide()`` is timed on its own, with a
config that answers and two plugins registered, and with no config and two voting plugins.
The process imports megatron-core, and with it ``filelock``, which installs a Python audit hook,
as every process that imports ``transformers`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import timeit
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mtp_hooks  # noqa: E402
from mtp_hooks.framework import cacheable_vote  # noqa: E402


class Vote:
    def __init__(self, vote):
        self.vote = vote

    @mtp_hooks.plugins.hookimpl
    def should_run_mtp(self, model, phase):
        return self.vote


class CachedVote(Vote):
    @mtp_hooks.plugins.hookimpl
    @cacheable_vote
    def should_run_mtp(self, model, phase):
        return self.vote


def per_call_us(fn, calls: int) -> float:
    return timeit.timeit(fn, number=calls) / calls * 1e6


def decide_cases(calls: int) -> dict[str, float]:
    mtp_hooks.testing.reset()
    mtp_hooks.plugins.register(Vote(None), name="abstains")
    mtp_hooks.plugins.register(Vote(False), name="skips-eval")
    votes = statistics.median(
        per_call_us(lambda: mtp_hooks.decide(None, "eval"), calls) for _ in range(9)
    )
    mtp_hooks.configure("train=run,eval=skip,rollout=skip")
    config = statistics.median(
        per_call_us(lambda: mtp_hooks.decide(None, "eval"), calls) for _ in range(9)
    )
    mtp_hooks.testing.reset()
    return {"decide_config_2_plugins_us": config, "decide_votes_2_plugins_us": votes}


def policy(config, plugin=None):
    """A case's setup: this policy config and, alone, this plugin."""

    def setup() -> None:
        mtp_hooks.configure(config)
        for name in ("vote", "cached_vote"):
            if mtp_hooks.plugins.get_plugin_manager().has_plugin(name):
                mtp_hooks.plugins.unregister(name)
        if plugin is not None:
            mtp_hooks.plugins.register(plugin, name=plugin.name)

    return setup


def hook_cases():
    """The modules to call, by case name, and the setup each case needs."""
    import torch

    from mtp_hooks.demo import tiny_models

    class Trivial(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return args[0]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tiny_models.init_single_process(port=tiny_models.free_port())
        torch.manual_seed(0)
        model = tiny_models.build_gpt(attention="sdpa")
    mtp_hooks.testing.reset()
    (gate,) = mtp_hooks.attach(model).gates
    gated = Trivial()
    object.__setattr__(gated, "mtp_process", model.mtp_process)
    object.__setattr__(gated, "config", model.config)
    gated.register_forward_pre_hook(gate.pre_hook, with_kwargs=True, prepend=True)
    gated.register_forward_hook(gate.post_hook, with_kwargs=True, always_call=True, prepend=True)
    noop = Trivial()
    noop.register_forward_pre_hook(lambda m, a, k: None, with_kwargs=True, prepend=True)
    noop.register_forward_hook(lambda m, a, k, o: None, with_kwargs=True, always_call=True)
    mtp_hooks.auto_attach()
    auto_plain = Trivial()
    mtp_hooks.auto_attach(False)
    voting, cached = Vote(True), CachedVote(True)
    voting.name, cached.name = "vote", "cached_vote"
    ids = torch.zeros(2, 16, dtype=torch.long)
    return (
        {
            "bare": (Trivial(), None),
            "noop": (noop, None),
            "run": (gated, policy("train=run")),
            "skip": (gated, policy("train=skip")),
            "vote": (gated, policy(None, voting)),
            "cached_vote": (gated, policy(None, cached)),
            "auto_plain": (auto_plain, None),
        },
        (ids, ids, None),
        {"labels": ids},
    )


def one_run(cases, args, kwargs, rounds: int, calls: int) -> dict[str, float]:
    names = list(cases)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            module, setup = cases[name]
            if setup is not None:
                setup()
                module(*args, **kwargs)  # the first call after a policy change decides
            samples[name].append(per_call_us(lambda m=module: m(*args, **kwargs), calls))
    bare = samples["bare"]
    floors = [noop - b for noop, b in zip(samples["noop"], bare, strict=True)]

    def added(case: str) -> float:
        return statistics.median(c - b for c, b in zip(samples[case], bare, strict=True))

    def ratio(case: str) -> float:
        return statistics.median(
            (c - b) / f for c, b, f in zip(samples[case], bare, floors, strict=True)
        )

    figures = {"torch_dispatch_us": statistics.median(floors)}
    for case in ("run", "skip", "vote", "cached_vote", "auto_plain"):
        figures[f"added_{case}_us"] = added(case)
    for case in ("run", "skip", "vote", "cached_vote"):
        figures[f"{case}_ratio"] = ratio(case)
    return figures


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--calls", type=int, default=400)
    options = parser.parse_args(argv)
    os.environ["MTP_HOOKS_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    meta = {
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
    }
    cases, args, kwargs = hook_cases()
    runs = []
    for _ in range(options.runs):
        figures = {
            **decide_cases(options.calls * 5),
            **one_run(cases, args, kwargs, options.rounds, options.calls),
        }
        runs.append(figures)
        print(
            json.dumps(
                {
                    "benchmark": "cpu_overhead",
                    **meta,
                    **{k: round(v, 3) for k, v in figures.items()},
                }
            )
        )
    labels = {
        "torch_dispatch_us": "floor: torch's cost of two no-op hooks (µs)",
        "added_run_us": "added per forward, run path (µs)",
        "added_skip_us": "added per forward, skip path (µs)",
        "run_ratio": "**run path / floor** (goal <= 2.0)",
        "skip_ratio": "**skip path / floor** (goal <= 3.0)",
        "vote_ratio": "run decided by a plugin asked every forward / floor",
        "cached_vote_ratio": "run decided by a `cacheable_vote` plugin / floor",
        "added_auto_plain_us": "plain module built with auto-attach on, added (µs)",
        "decide_config_2_plugins_us": "`decide()`, config answers, 2 plugins (µs; goal <= 2)",
        "decide_votes_2_plugins_us": "`decide()`, no config, 2 plugins vote (µs)",
    }
    print()
    print("| measure | " + " | ".join(f"run {i + 1}" for i in range(len(runs))) + " |")
    print("|---|" + "---|" * len(runs))
    for key, label in labels.items():
        print(f"| {label} | " + " | ".join(f"{r[key]:.2f}" for r in runs) + " |")
    return runs


if __name__ == "__main__":
    main()

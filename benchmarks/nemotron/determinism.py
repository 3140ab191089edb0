"""Which module of a Nemotron-3-shaped trunk computes a different output from the same input.

Run on one GPU with the staged packages (``benchmarks/megatron_rl/run.sh script NAME FILE``):
``python benchmarks/nemotron/determinism.py --spec te --pattern "MEMEM*EMEMEM*E" --hidden 2048
--ffn 1024 --vocab 131072 --experts 16 --topk 4 --seq 1024 --batch 2 [--deterministic]
[--out DIR]`` (the model arguments of ``gpu_mtp.py``; the pattern's MTP depths are dropped:
this is the trunk that ``gpu_hooks_ab.py --pair skip`` times as its control).

1. The trunk is built as ``gpu_mtp.py`` builds it, in ``eval()`` mode. ``--deterministic`` sets
   megatron's ``deterministic_mode``, Transformer Engine's ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``
   and ``torch.use_deterministic_algorithms(True, warn_only=True)``.
2. The same batch runs forward (``no_grad``) ``--runs`` times; forward hooks keep every
   module's output. Listed, in the order they ran: the modules whose output differs between
   the first run and any later one, with the largest difference.
3. Each of those is replayed alone, twice, on the inputs it got in the first run. A module
   whose replay differs computes differently by itself; the innermost such module (none of
   its own submodules does) holds the kernel. One replay of each is profiled, and its kernels
   are listed by device time.

Output: a JSON file (``--out``) and a summary on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/, for gpu_mtp and gpu_hooks_ab

from gpu_hooks_ab import profile_summary, profiler  # noqa: E402
from gpu_mtp import add_model_arguments, build_models, check_device  # noqa: E402


def leaves(value) -> list:
    """The tensors of a module's output (a tensor, a tuple, a dict, or nested ones)."""
    import torch
    from torch.utils._pytree import tree_leaves

    return [v for v in tree_leaves(value) if isinstance(v, torch.Tensor)]


def largest_difference(first: list, second: list) -> float:
    """The largest absolute difference between two outputs' tensors (inf where they differ in
    shape or count)."""
    if len(first) != len(second):
        return float("inf")
    worst = 0.0
    for a, b in zip(first, second, strict=True):
        if a.shape != b.shape:
            return float("inf")
        if a.numel() and not a.is_floating_point():
            worst = max(worst, float((a != b).any()))
        elif a.numel():
            worst = max(worst, float((a.float() - b.float()).abs().max()))
    return worst


def record(model, batch, runs: int) -> tuple[list[str], list[dict], dict]:
    """Run ``batch`` through ``model`` ``runs`` times; return the order the modules ran in, each
    run's outputs by module name (each module's first call), and each module's first inputs."""
    import torch

    names = {module: name for name, module in model.named_modules()}
    order: list[str] = []
    outputs: list[dict] = []
    inputs: dict = {}

    def before(module, args, kwargs):
        name = names[module]
        if name not in inputs:
            clone = lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
            inputs[name] = (
                tuple(clone(a) for a in args),
                {k: clone(v) for k, v in kwargs.items()},
            )

    def after(module, args, output):
        name = names[module]
        if name not in outputs[-1]:
            outputs[-1][name] = [t.detach().clone() for t in leaves(output)]
            if len(outputs) == 1:
                order.append(name)

    handles = [m.register_forward_pre_hook(before, with_kwargs=True) for m in names]
    handles += [m.register_forward_hook(after) for m in names]
    try:
        with torch.no_grad():
            for _ in range(runs):
                outputs.append({})
                model(*batch)
                synchronize()
    finally:
        for handle in handles:
            handle.remove()
    return order, outputs, inputs


def inside(name: str, outer: str) -> bool:
    """Whether module ``name`` is a submodule of ``outer`` (``""``: the model itself)."""
    return name != outer and (outer == "" or name.startswith(f"{outer}."))


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():  # --device cpu smoke runs have nothing to wait for
        torch.cuda.synchronize()


def replay(module, args, kwargs):
    import torch

    with torch.no_grad():
        out = [t.detach().clone() for t in leaves(module(*args, **kwargs))]
        synchronize()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.deterministic:
        os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"
    check_device(args.device)
    import torch

    if args.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    args.pattern = args.pattern.split("/")[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (model,) = build_models(args, False)
        model.eval()
        torch.manual_seed(1)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device)
        pos = torch.arange(args.seq, device=args.device).unsqueeze(0).expand(args.batch, -1)
        order, outputs, inputs = record(model, (ids, pos, None), args.runs)
        modules = dict(model.named_modules())
        differs = {}
        for name in order:
            worst = max(largest_difference(outputs[0][name], o[name]) for o in outputs[1:])
            if worst > 0:
                differs[name] = worst
        by_itself = {}
        for name in differs:
            call = inputs.get(name)
            if call is None:
                continue
            try:
                first, second = replay(modules[name], *call), replay(modules[name], *call)
            except Exception as error:  # a module that cannot run alone: say so and go on
                by_itself[name] = {"replay_error": f"{type(error).__name__}: {error}"[:300]}
                continue
            worst = largest_difference(first, second)
            if worst > 0:
                by_itself[name] = {"largest_difference": worst}
        innermost = [
            name
            for name, found in by_itself.items()
            if "largest_difference" in found
            and not any(
                inside(other, name) and "largest_difference" in f for other, f in by_itself.items()
            )
        ]
        kernels = {}
        for name in innermost:
            prof = profiler()
            with prof:
                replay(modules[name], *inputs[name])
            kernels[name] = profile_summary(prof)
    result = {
        "benchmark": "nemotron_determinism",
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "args": {k: v for k, v in vars(args).items() if k not in ("out",)},
        "modules": len(order),
        "output_difference": differs.get("", 0.0),
        "differ": {name: differs[name] for name in order if name in differs},
        "types": {name: type(modules[name]).__name__ for name in differs},
        "by_itself": by_itself,
        "innermost": innermost,
        "kernels": kernels,
    }
    print(
        f"{len(differs)} of {len(order)} modules differ between runs; the model's output by "
        f"{result['output_difference']:.4g}"
    )
    for name in list(result["differ"])[:12]:
        print(f"  {name or '(model)'} [{result['types'][name]}]: {differs[name]:.4g}")
    for name in innermost:
        print(f"\nnondeterministic by itself: {name} [{result['types'][name]}], kernels:")
        print(kernels[name]["device"])
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "determinism.json"), "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()

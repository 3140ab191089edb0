"""The Nemotron-3-shaped ``HybridModel`` the GPU tests share, and how they compare its runs.

megatron's own TE ``hybrid_stack_spec``: a trunk of Mamba-2, attention and MoE layers
(``M*MEME``: sigmoid router with expert bias, grouped GEMM, all-to-all dispatcher) and two
attention + MoE MTP depths (``/*E/*E``), bf16 weights, on one GPU.

Where a kernel is not deterministic (mamba-ssm's and causal-conv1d's backward kernels add into
their gradients atomically), a comparison is held against the same computation's own
run-to-run spread: :func:`within_spread` prints, per parameter, that spread and the difference,
so that a run records which kernels vary (docs/benchmarks.md).

One pair of runs can read a spread of 0 where the kernel does vary: causal-conv1d's weight
gradient differed between identical steps in one run and not in the next. The gradients that
kernel writes (:data:`ATOMIC_GRADIENTS`) may therefore also differ by :data:`ATOMIC_ULPS` units in
the last place of bf16 at the tensor's largest gradient; every other tensor is held to the
measured spread alone.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mtp_hooks.demo import nemotron_models, tiny_models

from model_fixtures import has_transformer_engine

MARKS = [
    pytest.mark.skipif(
        not has_transformer_engine(), reason="needs a CUDA GPU and transformer_engine"
    ),
    pytest.mark.skipif(
        not nemotron_models.can_build_mamba(), reason="megatron's Mamba-2 layer needs mamba-ssm"
    ),
    pytest.mark.usefixtures("nemotron_tracker"),
]
"""What a module of tests on this model needs: its ``pytestmark``."""

PATTERN = "M*MEME/*E/*E"
TRUNK, DEPTHS = PATTERN.split("/")[0], PATTERN.count("/")
SEQ, BATCH, VOCAB = 128, 2, 1024


def spec() -> tiny_models.TinySpec:
    return tiny_models.TinySpec(
        hidden_size=256,
        num_attention_heads=4,
        ffn_hidden_size=512,
        vocab_size=VOCAB,
        seq_length=SEQ,
        rmsnorm=True,
        bias=False,
        params_dtype=torch.bfloat16,
    )


def build(pattern: str = PATTERN, recipe: str = "bf16", seed: int = 0, **kwargs: Any) -> Any:
    """The model on TE, seeded: the same ``seed`` gives the same weights whatever ``kwargs``
    (recompute, CUDA graphs) change about how it runs."""
    fp8 = {} if recipe == "bf16" else {"fp8": "hybrid", "fp8_recipe": recipe}
    torch.manual_seed(seed)
    model = nemotron_models.build_nemotron(
        spec(), pattern=pattern, transformer_impl="transformer_engine", **fp8, **kwargs
    )
    return model.cuda()


def trunk_twin(model: Any, **kwargs: Any) -> Any:
    """The same trunk built without MTP, carrying ``model``'s trunk weights."""
    plain = build(TRUNK, **kwargs)
    trunk_weights = {k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")}
    missing, unexpected = plain.load_state_dict(trunk_weights, strict=False)
    assert [k for k in missing if not k.endswith("_extra_state")] == [] and unexpected == []
    return plain


def batch(seed: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=g)
    pos = torch.arange(SEQ, device="cuda").unsqueeze(0).expand(BATCH, -1)
    return ids, pos, torch.roll(ids, -1, dims=1)


def grads_of(model: Any, data: tuple) -> tuple[torch.Tensor, dict]:
    """One training forward and backward from zeroed gradients: the loss, and every
    parameter's gradient (``None`` where none arrived)."""
    ids, pos, labels = data
    model.zero_grad(set_to_none=True)
    model.train()
    loss = model(ids, pos, None, labels=labels)
    loss.float().sum().backward()
    return loss.detach(), {
        n: None if p.grad is None else p.grad.detach().float().clone()
        for n, p in model.named_parameters()
    }


def trunk(grads: dict) -> dict:
    return {n: g for n, g in grads.items() if not n.startswith("mtp.")}


ATOMIC_GRADIENTS = ("mixer.conv1d_weight", "mixer.conv1d_bias")
"""Gradients written by causal-conv1d's backward, which accumulates them atomically."""
ATOMIC_ULPS = 2
"""How many bf16 units in the last place such a gradient may differ by, element by element,
beyond the measured spread; an element smaller than 1/256 of the tensor's largest gradient is
held to the units of that 1/256 (where a sum cancels, its rounding is that of its terms)."""


def only_rounding(name: str, got: torch.Tensor, ref: torch.Tensor) -> bool:
    """Whether ``got`` differs from ``ref`` by no more than the rounding of an atomic sum: only
    for :data:`ATOMIC_GRADIENTS`, within ``ATOMIC_ULPS`` bf16 units in the last place."""
    if not name.endswith(ATOMIC_GRADIENTS):
        return False
    scale = torch.maximum(ref.abs(), got.abs()).clamp_min(ref.abs().max().item() / 256)
    ulps = ATOMIC_ULPS * torch.finfo(torch.bfloat16).eps * scale
    return bool(((got - ref).abs() <= ulps).all())


def within_spread(label: str, got: dict, reference: dict, again: dict) -> list[str]:
    """Print each parameter's run-to-run spread (``reference`` against ``again``) and ``got``'s
    difference from ``reference``; return the parameters whose difference exceeds twice the
    spread (any difference where the spread is zero), unless :func:`only_rounding` holds."""
    over, varying = [], []
    assert got.keys() == reference.keys() == again.keys()
    for name, ref in reference.items():
        if ref is None or got[name] is None:
            if (ref is None) != (got[name] is None):
                over.append(f"{name}: a gradient on one side only")
            continue
        spread = (ref - again[name]).abs().max().item()
        diff = (ref - got[name]).abs().max().item()
        if spread > 0:
            varying.append(name)
        rounding = diff > 2 * spread and only_rounding(name, got[name], ref)
        if diff > 2 * spread and not rounding:
            over.append(f"{name}: diff {diff:.3g} spread {spread:.3g}")
        if diff > 0 or spread > 0:
            note = f" (within {ATOMIC_ULPS} bf16 ulps: atomic rounding)" if rounding else ""
            print(f"[{label}] {name}: diff {diff:.3g} spread {spread:.3g}{note}")
    print(f"[{label}] {len(varying)}/{len(reference)} parameters vary run to run: {varying}")
    return over

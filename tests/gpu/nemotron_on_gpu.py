"""The Nemotron-3-shaped ``HybridModel`` the GPU tests share, and how they compare its runs.

megatron's own TE ``hybrid_stack_spec``: a trunk of Mamba-2, attention and MoE layers
(``M*MEME``: sigmoid router with expert bias, grouped GEMM, all-to-all dispatcher) and two
attention + MoE MTP depths (``/*E/*E``), bf16 weights, on one GPU.

Where a kernel is not deterministic (mamba-ssm's and causal-conv1d's backward kernels add into
their gradients atomically), a comparison is held against the same computation's own
run-to-run spread: :func:`within_spread` prints, per parameter, that spread and the difference,
so that a run records which kernels vary (docs/benchmarks.md).
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


def within_spread(label: str, got: dict, reference: dict, again: dict) -> list[str]:
    """Print each parameter's run-to-run spread (``reference`` against ``again``) and ``got``'s
    difference from ``reference``; return the parameters whose difference exceeds the spread
    by more than a factor of two (or differ at all where the spread is zero)."""
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
        if diff > 2 * spread:
            over.append(f"{name}: diff {diff:.3g} spread {spread:.3g}")
        if diff > 0 or spread > 0:
            print(f"[{label}] {name}: diff {diff:.3g} spread {spread:.3g}")
    print(f"[{label}] {len(varying)}/{len(reference)} parameters vary run to run: {varying}")
    return over

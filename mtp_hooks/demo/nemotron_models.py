"""Build small real Nemotron-3-shaped megatron-core ``HybridModel`` instances.

Nemotron 3 is a ``HybridModel`` whose trunk mixes Mamba-2 (``M``), attention (``*``) and MoE
(``E``) layers, the MoE layers routed by a sigmoid router with expert bias, and whose MTP depths
are attention + MoE layers. :func:`build_nemotron` builds that shape from megatron's own specs,
at the sizes of a :class:`~mtp_hooks.demo.tiny_models.TinySpec`. Used by the demo, the tests and
the benchmarks; megatron-core must already be initialized
(:func:`~mtp_hooks.demo.tiny_models.init_single_process`).
"""

from __future__ import annotations

from typing import Any

import torch

from . import tiny_models

__all__ = ["NEMOTRON_PATTERN", "build_nemotron", "can_build_mamba"]

NEMOTRON_PATTERN = "ME*E/*E/*E"
"""The smallest Nemotron-3-shaped pattern: a trunk of Mamba-2 (``M``), MoE (``E``) and attention
(``*``) layers, and two MTP depths of attention + MoE (``/*E``)."""


def can_build_mamba() -> bool:
    """Whether megatron's Mamba-2 layer can be built here: megatron-core 0.18+ and mamba-ssm's
    Triton SSD kernels importable (what megatron's ``HAVE_MAMBA_SSM`` reports)."""
    try:
        from megatron.core.ssm import mamba_mixer
    except ImportError:
        return False
    return bool(getattr(mamba_mixer, "HAVE_MAMBA_SSM", False))


def _has_causal_conv1d() -> bool:
    import importlib.util

    return importlib.util.find_spec("causal_conv1d") is not None


def build_nemotron(
    spec: tiny_models.TinySpec | None = None,
    *,
    pattern: str = NEMOTRON_PATTERN,
    num_experts: int = 4,
    topk: int = 2,
    expert_bias: bool = True,
    repeated_mtp: bool = False,
    transformer_impl: str = "local",
    attention: str = "local",
    pre_process: bool = True,
    post_process: bool = True,
    share_embeddings: bool = False,
    **config_overrides: Any,
) -> Any:
    """Build a Nemotron-3-shaped ``HybridModel`` (megatron-core 0.18+): Mamba-2, attention and MoE
    layers in the trunk, attention + MoE MTP depths, RMSNorm, no biases, no position embedding.

    Args:
        spec: Sizes; ``spec.mtp_num_layers`` is ignored (the pattern's ``/`` depths set it).
        pattern: A hybrid layer pattern; each ``/`` starts an MTP depth. A pattern without
            ``M`` builds on any machine; with ``M`` it needs mamba-ssm (:func:`can_build_mamba`).
        num_experts, topk: The MoE layers' experts and the experts each token is routed to.
        expert_bias: A sigmoid router with expert bias (aux-loss-free balancing), as Nemotron 3
            routes. megatron allocates the bias with ``torch.cuda.current_device()``, so on a
            CPU this needs ``expert_bias=False``.
        repeated_mtp: ``mtp_use_repeated_layer``: one MTP layer's weights serve every depth.
        transformer_impl: ``"local"`` or ``"transformer_engine"`` (megatron's own TE-based
            ``hybrid_stack_spec``, CUDA only).
        attention: ``"local"`` or ``"sdpa"`` (local modules only).
        pre_process, post_process, share_embeddings: As for
            :func:`~mtp_hooks.demo.tiny_models.build_gpt`.
        **config_overrides: Extra ``TransformerConfig`` fields.

    The Mamba-2 layers take megatron's memory-efficient training path where causal-conv1d is
    installed (as Nemotron 3 trains) and its plain path (torch's ``Conv1d``) elsewhere.
    """
    spec = spec or tiny_models.TinySpec(rmsnorm=True, bias=False)
    parts = pattern.split("/")
    depths = len(parts) - 1
    cuda = torch.cuda.is_available()
    fields: dict[str, Any] = dict(
        num_moe_experts=num_experts,
        moe_router_topk=topk,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=expert_bias,
        moe_router_load_balancing_type="none",
        moe_router_dtype="fp32",
        # alltoall makes a CUDA stream when it is built; allgather routes the same tokens
        moe_token_dispatcher_type="alltoall" if cuda else "allgather",
        moe_grouped_gemm=transformer_impl == "transformer_engine",
        # Nemotron 3 sizes (64-wide heads, a 128-wide state) where the hidden size allows
        mamba_head_dim=min(64, max(16, spec.hidden_size // 4)),
        mamba_state_dim=min(128, max(16, spec.hidden_size // 8)),
        mamba_num_groups=1 if spec.hidden_size < 512 else 8,
        use_mamba_mem_eff_path=_has_causal_conv1d(),
        mtp_use_repeated_layer=repeated_mtp,
    )
    fields.update(config_overrides)
    sized = tiny_models.TinySpec(**{**vars(spec), "mtp_num_layers": depths or None})
    # build_hybrid's local spec names 4 experts: megatron's MoE spec only checks that a count
    # is given, and the config's num_moe_experts decides, as in its own TE hybrid spec
    return tiny_models.build_hybrid(
        sized,
        attention=attention,
        transformer_impl=transformer_impl,
        pattern=pattern,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings=share_embeddings,
        **fields,
    )

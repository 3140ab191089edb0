"""Megatron layer specs built from local (non-Transformer-Engine) modules, for CPU runs.

``hybrid_stack_spec`` is a ``HybridStack`` spec of attention (``*``), MLP (``-``), MoE (``E``),
Mamba-2 (``M``) and MTP layers from megatron's local modules, without TE or Apex. Only a
pattern with ``M`` needs mamba-ssm (megatron's Mamba-2 mixer runs its Triton SSD kernels).
``sdpa_core_attention`` is a core-attention module with megatron's ``DotProductAttention``
interface that needs no CUDA scratch buffer. ``check_impl`` says whether a builder takes
Transformer Engine's specs instead, and refuses them where Transformer Engine does not import.
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import Any

import torch


def check_impl(transformer_impl: str) -> bool:
    """Whether ``transformer_impl`` asks for Transformer Engine, which must then import (else
    megatron's specs hold ``None`` for its modules and fail later, naming no cause)."""
    if transformer_impl not in ("local", "transformer_engine"):
        raise ValueError(
            f"transformer_impl must be 'local' or 'transformer_engine', not {transformer_impl!r}"
        )
    try:
        if transformer_impl == "transformer_engine":
            importlib.import_module("transformer_engine.pytorch")
    except Exception as exc:  # missing, or installed without the CUDA it needs
        raise ImportError(
            "transformer_impl='transformer_engine' needs Transformer Engine, which does not "
            f"import here ({type(exc).__name__}: {exc}); install it on a CUDA machine "
            "(pip install '.[te]') or build with transformer_impl='local'"
        ) from exc
    return transformer_impl == "transformer_engine"


@functools.lru_cache(maxsize=1)
def sdpa_core_attention() -> type:
    """The SDPA core-attention class (built on first use: it subclasses a megatron class)."""
    from megatron.core.transformer.module import MegatronModule

    class _SDPACoreAttention(MegatronModule):  # type: ignore[misc]
        """Causal core attention through ``torch.nn.functional.scaled_dot_product_attention``.

        Takes the constructor and forward arguments of megatron's ``DotProductAttention`` so it
        can stand in a layer spec; unlike it, it allocates no CUDA scratch buffer.
        """

        def __init__(
            self,
            config: Any,
            layer_number: int,
            attn_mask_type: Any,
            attention_type: Any,
            **kwargs: Any,
        ) -> None:
            super().__init__(config=config)
            heads = config.num_attention_heads
            self.head_dim = config.kv_channels or config.hidden_size // heads
            self.softmax_scale = kwargs.get("softmax_scale") or 1.0 / math.sqrt(self.head_dim)
            self.cp_group = None
            if config.context_parallel_size > 1:
                groups = kwargs.get("pg_collection")
                if groups is not None and getattr(groups, "cp", None) is not None:
                    self.cp_group = groups.cp
                else:
                    from megatron.core import parallel_state

                    self.cp_group = parallel_state.get_context_parallel_group()

        def forward(
            self,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: Any,
            attn_mask_type: Any = None,
            **kwargs: Any,
        ) -> torch.Tensor:
            packed = kwargs.get("packed_seq_params")
            thd = query.dim() == 3  # packed sequences: [t, n, d], one batch row of sequences
            if thd:
                query, key, value = (t.unsqueeze(1) for t in (query, key, value))
            # [s, b, n, d] -> [b, n, s, d]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            if k.shape[1] != q.shape[1]:
                k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
                v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
            mask = None
            if self.cp_group is not None:
                if packed is not None:
                    raise NotImplementedError(
                        "the demo's SDPA attention takes packed sequences or context "
                        "parallelism, not both"
                    )
                k, v, mask = _gather_context(q, k, v, self.cp_group)
            elif packed is not None:  # causal within each sequence, nothing across them
                mask = _packed_causal_mask(packed.cu_seqlens_q, q.shape[2], q.device)
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.softmax_scale
            )
            s, b = query.shape[0], query.shape[1]
            out = out.permute(2, 0, 1, 3).reshape(s, b, -1)
            return out.squeeze(1) if thd else out

    return _SDPACoreAttention


def _packed_causal_mask(
    cu_seqlens: torch.Tensor, tokens: int, device: torch.device
) -> torch.Tensor:
    """The mask of ``tokens`` packed tokens, on ``device``: each attends to the earlier tokens of
    its own sequence (``cu_seqlens`` bounds the sequences, on any device)."""
    ends = cu_seqlens[1:].to(device=device, dtype=torch.long)
    which = torch.searchsorted(ends, torch.arange(tokens, device=device), right=True)
    return (which[:, None] == which[None, :]).tril()


def _gather_context(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every CP rank's keys and values, and the causal mask of this rank's queries over them.

    megatron splits a sequence into ``2 * cp`` chunks and gives rank ``r`` chunks ``r`` and
    ``2 * cp - 1 - r`` (balancing causal work), so a token's place is known from its rank and
    index; the gather keeps autograd, so keys' gradients flow back to the ranks they came from.
    """
    from torch.distributed.nn.functional import all_gather

    size, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    chunk = q.shape[2] // 2

    def places(r: int) -> torch.Tensor:
        return torch.cat(
            [
                torch.arange(r * chunk, (r + 1) * chunk),
                torch.arange((2 * size - 1 - r) * chunk, (2 * size - r) * chunk),
            ]
        )

    keys = torch.cat(all_gather(k.contiguous(), group=group), dim=2)  # type: ignore[no-untyped-call]
    values = torch.cat(all_gather(v.contiguous(), group=group), dim=2)  # type: ignore[no-untyped-call]
    where = torch.cat([places(r) for r in range(size)]).to(q.device)
    mask = places(rank).to(q.device)[:, None] >= where[None, :]
    return keys, values, mask


def hybrid_stack_spec(attention: str = "local", num_experts: int = 4) -> Any:
    """A ``HybridStack`` spec of local modules: attention (``*``), MLP (``-``), MoE (``E``,
    ``num_experts`` experts without grouped GEMM), Mamba-2 (``M``) and an MTP block whose depths
    take their layers from the same spec (``/*E`` is an attention + MoE depth)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock,
        MultiTokenPredictionBlockSubmodules,
        MultiTokenPredictionLayer,
        MultiTokenPredictionLayerSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    core_attention = DotProductAttention if attention == "local" else sdpa_core_attention()
    attention_layer = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=WrappedTorchNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=core_attention,
                    linear_proj=RowParallelLinear,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
        ),
    )
    mlp_layer = ModuleSpec(
        module=MLPLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=WrappedTorchNorm,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(
                    linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear
                ),
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )
    moe_layer = ModuleSpec(
        module=MoETransformerLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=WrappedTorchNorm,
            mlp=get_moe_module_spec(use_te=False, num_experts=num_experts, moe_grouped_gemm=False),
            mlp_bda=get_bias_dropout_add,
        ),
    )
    mamba_layer = ModuleSpec(
        module=MambaLayer,
        submodules=MambaLayerSubmodules(
            norm=WrappedTorchNorm,
            mixer=ModuleSpec(
                module=MambaMixer,
                submodules=MambaMixerSubmodules(
                    in_proj=ColumnParallelLinear, out_proj=RowParallelLinear
                ),
            ),
            mamba_bda=get_bias_dropout_add,
        ),
    )
    mtp_block = ModuleSpec(
        module=MultiTokenPredictionBlock,
        submodules=MultiTokenPredictionBlockSubmodules(
            layer_specs=[
                ModuleSpec(
                    module=MultiTokenPredictionLayer,
                    submodules=MultiTokenPredictionLayerSubmodules(
                        enorm=WrappedTorchNorm,
                        hnorm=WrappedTorchNorm,
                        eh_proj=ColumnParallelLinear,
                        mtp_model_layer=None,
                        layer_norm=WrappedTorchNorm,
                    ),
                )
            ]
        ),
    )
    return ModuleSpec(
        module=HybridStack,
        params={"post_layer_norm": False},
        submodules=HybridStackSubmodules(
            mamba_layer=mamba_layer,
            attention_layer=attention_layer,
            mlp_layer=mlp_layer,
            moe_layer=moe_layer,
            mtp_block_spec=mtp_block,
        ),
    )

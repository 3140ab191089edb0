"""Build small real megatron-core ``GPTModel`` and ``HybridModel`` instances with an MTP block.
The Nemotron 3 shape (Mamba-2, attention, MoE) is in :mod:`mtp_hooks.demo.nemotron_models`.

Used by ``mtp-hooks demo``, the benchmarks and the tests. Everything uses megatron-core's local
(non-Transformer-Engine) modules, so the models run on a CPU. ``attention="sdpa"`` swaps the core
attention for a ``scaled_dot_product_attention`` module (``_local_specs``) that needs no CUDA
scratch buffer and takes packed sequences and context parallelism; ``attention="local"`` keeps
megatron's own ``DotProductAttention``. megatron-core must already be initialized
(torch.distributed plus megatron's parallel state): see :func:`init_single_process`.
"""

from __future__ import annotations

import atexit
import copy
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch

from . import _local_specs

__all__ = [
    "MTPForwards",
    "TinySpec",
    "free_port",
    "init_single_process",
    "build_gpt",
    "build_hybrid",
    "reset_mtp_loss_tracker",
    "recorded_mtp_loss",
]


@dataclass
class TinySpec:
    """Sizes of a model built by :func:`build_gpt` or :func:`build_hybrid`."""

    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 4
    num_query_groups: int | None = None
    ffn_hidden_size: int | None = None
    vocab_size: int = 128
    seq_length: int = 16
    mtp_num_layers: int | None = 1
    swiglu: bool = False
    rmsnorm: bool = False
    bias: bool = True
    params_dtype: torch.dtype = torch.float32
    extra: dict[str, Any] | None = None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now, for a process group's MASTER_PORT."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def init_single_process(port: int | None = None) -> None:
    """Initialize a one-rank gloo process group and megatron's model parallel state (TP=PP=1).

    A group created here is destroyed at exit (``atexit``): left to interpreter finalization,
    gloo's threads can abort a finished script (``terminate called without an active exception``).
    """
    from megatron.core import parallel_state, tensor_parallel

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if port is not None:
            os.environ["MASTER_PORT"] = str(port)
        os.environ.setdefault("MASTER_PORT", "29555")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        torch.distributed.init_process_group(backend, rank=0, world_size=1)
        atexit.register(_destroy_process_groups)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def _destroy_process_groups() -> None:
    """Tear down megatron's groups and torch's while the interpreter is still whole."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _config(spec: TinySpec, **overrides: Any) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs: dict[str, Any] = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        ffn_hidden_size=spec.ffn_hidden_size,
        mtp_num_layers=spec.mtp_num_layers,
        mtp_loss_scaling_factor=0.1,
        use_cpu_initialization=not torch.cuda.is_available(),
        attention_dropout=0.0,
        hidden_dropout=0.0,
        params_dtype=spec.params_dtype,
        bf16=spec.params_dtype == torch.bfloat16,
        gated_linear_unit=spec.swiglu,
        add_bias_linear=spec.bias,
    )
    if spec.swiglu:
        kwargs["activation_func"] = torch.nn.functional.silu
    if spec.rmsnorm:
        kwargs["normalization"] = "RMSNorm"
    kwargs.update(spec.extra or {})
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _swap_attention(layer_spec: Any, attention: str) -> Any:
    if attention == "local":
        return layer_spec
    if attention != "sdpa":
        raise ValueError(f"attention must be 'local' or 'sdpa', not {attention!r}")
    layer_spec = copy.deepcopy(layer_spec)
    layer_spec.submodules.self_attention.submodules.core_attention = (
        _local_specs.sdpa_core_attention()
    )
    return layer_spec


def build_gpt(
    spec: TinySpec | None = None,
    *,
    attention: str = "local",
    transformer_impl: str = "local",
    pre_process: bool = True,
    post_process: bool = True,
    share_embeddings: bool = False,
    model_cls: type | None = None,
    with_mtp_block: bool = True,
    position_embedding: str | None = None,
    **config_overrides: Any,
) -> Any:
    """Build a ``GPTModel`` from megatron's local layer spec, with an MTP block of the spec's depth.

    Args:
        spec: Sizes; the defaults give a model of a few hundred thousand parameters.
        attention: ``"local"`` (megatron's ``DotProductAttention``) or ``"sdpa"``.
        transformer_impl: ``"local"`` (megatron's own modules, which run on a CPU) or
            ``"transformer_engine"`` (megatron's Transformer Engine layer and MTP specs, as
            Megatron-LM's ``--transformer-impl transformer_engine``; CUDA only, and
            ``attention`` is then TE's).
        pre_process, post_process: Build the embedding, the output layer (False mimics a
            later, an earlier pipeline stage).
        share_embeddings, model_cls: ``share_embeddings_and_output_weights``; a subclass.
        with_mtp_block: False builds no MTP block even though ``mtp_num_layers`` is set, like
            a pipeline stage that holds no MTP layer.
        position_embedding: megatron's ``position_embedding_type`` (default: ``"rope"`` on a
            GPU, ``"learned_absolute"`` on a CPU); ``"none"`` on a CPU for callers that pass
            no ``position_ids``, as veRL's packed forwards do.
        **config_overrides: Extra ``TransformerConfig`` fields.
    """
    from megatron.core.models.gpt import GPTModel, gpt_layer_specs

    spec = spec or TinySpec()
    config = _config(spec, **config_overrides)
    te = _local_specs.check_impl(transformer_impl)
    default_positions = "rope" if torch.cuda.is_available() else "learned_absolute"
    if te:
        layer_spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    else:
        layer_spec = _swap_attention(gpt_layer_specs.get_gpt_layer_local_spec(), attention)
    mtp_spec = None
    if spec.mtp_num_layers and with_mtp_block:
        mtp_spec = gpt_layer_specs.get_gpt_mtp_block_spec(
            config, layer_spec, use_transformer_engine=te
        )
    return (model_cls or GPTModel)(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=share_embeddings,
        position_embedding_type=position_embedding or default_positions,
        mtp_block_spec=mtp_spec,
    )


def build_hybrid(
    spec: TinySpec | None = None,
    *,
    attention: str = "local",
    transformer_impl: str = "local",
    pattern: str | None = None,
    pre_process: bool = True,
    post_process: bool = True,
    share_embeddings: bool = False,
    model_cls: type | None = None,
    **config_overrides: Any,
) -> Any:
    """Build a ``HybridModel`` (megatron-core 0.18+) with attention/MLP layers and MTP depths.

    Args:
        spec: Sizes. ``spec.num_layers`` attention+MLP pairs are built unless ``pattern`` is given.
        attention: ``"local"`` or ``"sdpa"``.
        pattern: A hybrid layer pattern such as ``"*-*-/*-"``; ``/`` starts each MTP depth.
        transformer_impl: ``"local"``, or ``"transformer_engine"`` for megatron's own
            TE-based ``hybrid_stack_spec`` (CUDA only).
        pre_process, post_process, share_embeddings, model_cls, config_overrides: As for
            :func:`build_gpt`.
    """
    try:
        from megatron.core.models.hybrid.hybrid_model import HybridModel
    except ImportError as exc:
        raise ImportError(
            "HybridModel needs megatron-core 0.18 or later (models/hybrid), and megatron-core "
            "0.17 and later need Python 3.12; this one has no models.hybrid"
        ) from exc

    spec = spec or TinySpec()
    if pattern is None:
        pattern = "*-" * spec.num_layers + "/*-" * (spec.mtp_num_layers or 0)
    main_layers = len(pattern.split("/")[0])
    config = _config(spec, num_layers=main_layers, **config_overrides)
    if _local_specs.check_impl(transformer_impl):
        from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
    else:
        hybrid_stack_spec = _local_specs.hybrid_stack_spec(attention)
    return (model_cls or HybridModel)(
        config=config,
        hybrid_stack_spec=hybrid_stack_spec,
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.seq_length,
        hybrid_layer_pattern=pattern,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=share_embeddings,
        position_embedding_type="none",
    )


_TRACKER_KEYS = ("values", "loss_values", "correct_values", "total_values")


def reset_mtp_loss_tracker(num_layers: int = 1, device: str | torch.device = "cpu") -> None:
    """Empty megatron's MTP loss tracker and pre-create its tensors on ``device``.

    ``MTPLossLoggingHelper`` creates its tracker tensors on CUDA the first time a loss is
    recorded, unless they already exist; putting zeros there first lets MTP training run on a CPU
    and makes :func:`recorded_mtp_loss` an exact observable of "the MTP loss ran".
    """
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()
    for key in _TRACKER_KEYS:
        MTPLossLoggingHelper.tracker[key] = torch.zeros(num_layers, device=device)


def recorded_mtp_loss() -> float:
    """The sum of MTP losses recorded since :func:`reset_mtp_loss_tracker` (0.0 if none)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    # "values" up to megatron-core 0.16, "loss_values" from 0.17 on.
    return sum(
        float(tracker[key].detach().abs().sum())
        for key in ("values", "loss_values")
        if torch.is_tensor(tracker.get(key))
    )


class MTPForwards:
    """Counts the forwards of ``model.mtp`` (a forward hook on it): did MTP really run.

    Example:
        .. code-block:: python

            ran = MTPForwards(model)
            model(ids, pos, mask, labels=labels)
            assert ran.n == 1
            ran.remove()
    """

    def __init__(self, model: Any) -> None:
        self.n = 0
        self.handle = model.mtp.register_forward_hook(self._count)

    def _count(self, *args: Any) -> None:
        self.n += 1

    def remove(self) -> None:
        """Stop counting."""
        self.handle.remove()

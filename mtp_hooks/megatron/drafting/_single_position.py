"""MTP drafts computed the way megatron-core's inference engine computes them.

Training runs each MTP depth over the whole sequence: the depth's attention at position ``i``
sees positions ``0..i``. megatron-core's engine (0.17 on) drafts after each verify step through
``compute_mtp_single_step``: the depth's layer runs on the verified position alone, with no
cache of earlier positions, so its attention sees nothing of the sequence before. The two are
different functions of the same weights, and a drafter that leans on that context drafts
worse in the engine than a teacher-forced figure says.

:func:`single_position_logits` runs megatron's own ``forward_single_position`` of each MTP
layer (what ``compute_mtp_single_step`` runs) with every position of a recorded forward as its
own batch row (``[1, positions, hidden]``): what the engine computes for one request at a
time. The engine batches its requests as one sequence (``[requests, 1, hidden]``) under the
layer's causal mask, so there a request's draft also attends over the requests batched before
it; no teacher-forced figure can know that batch.

An MoE depth (DeepSeek-V3, Nemotron 3) routes the extra forward's tokens too. Under ``no_grad``
megatron's routers count nothing for their expert bias and add no auxiliary loss, and every
buffer of the MTP block is put back as it was afterwards, so the extra forward leaves the
routers as the recorded forward left them, whatever the release counts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import _capabilities
from . import _vocab_parallel

__all__ = ["single_position_logits", "supported"]


def supported(model: Any) -> bool:
    """Whether this model can draft position by position as the engine does, in an extra
    forward of its MTP layers that changes nothing: they have megatron-core's
    ``forward_single_position`` (0.17 on), and none of the settings below is on. MoE depths
    can: their routers' buffers are restored after the extra forward."""
    if not _capabilities.drafts_single_positions(model):
        return False
    config = model.config
    graphs = getattr(config, "cuda_graph_impl", "none") not in ("none", None)
    return not (
        getattr(config, "sequence_parallel", False)  # splits the rows requests stack along
        or (getattr(config, "context_parallel_size", 1) or 1) > 1  # trades keys across ranks
        or getattr(config, "fp8", None)  # the extra forward would move the scaling state
        or getattr(config, "fp4", None)
        or getattr(config, "enable_cuda_graph", False)  # a captured layer meets a new shape
        or graphs
    )


def single_position_logits(
    model: Any,
    decoder_hidden: torch.Tensor,
    input_ids: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    roll: Callable[[torch.Tensor], Any],
    weight: torch.Tensor | None = None,
) -> list[torch.Tensor] | None:
    """Per depth, ``[s, b, v]`` logits (the whole vocabulary on every rank) of the drafts the
    engine computes at each position, or ``None`` where it cannot be done (see
    :func:`supported`, and no ``input_ids``).

    Depth ``d`` at position ``i`` reads the token at ``i + d + 1`` (``input_ids`` rolled as
    training rolls them, so context and tensor parallelism and packed sequences line up with
    the depth's labels) and the hidden state depth ``d - 1`` produced there (the decoder's for
    the first depth), as the engine does along a chain of accepted drafts. ``weight`` (a tied
    output weight) is the caller's, as for the depths' own projections, and the logits are
    scaled as those are (MuP).

    This is the body of megatron's ``compute_mtp_single_step`` with two differences: the
    projection goes through ``output_layer.forward``, not the module call, so that hooks that
    count megatron's own projections (``+objective``'s, a framework's) never see it; and it
    runs under ``no_grad`` rather than ``inference_mode``, so its tensors are ordinary ones.
    """
    if not supported(model) or input_ids is None:
        return None
    s, b, h = decoder_hidden.shape
    if position_ids is None:
        position_ids = torch.arange(s, device=input_ids.device).expand(b, s)
    repeated = bool(getattr(model.mtp, "mtp_use_repeated_layer", False))
    current = decoder_hidden.reshape(1, s * b, h)  # sequence length 1: one position a row
    tokens, positions = input_ids, position_ids
    out = []
    with torch.no_grad(), _buffers_restored(model.mtp):
        for depth in range(model.config.mtp_num_layers):
            tokens, _ = roll(tokens)
            positions, _ = roll(positions)
            current = model.mtp.layers[0 if repeated else depth].forward_single_position(
                hidden_states=current,
                next_token_ids=tokens.t().reshape(s * b, 1),
                position_ids=positions.t().reshape(s * b, 1),
                embedding=model.embedding,
            )
            logits, _ = model.output_layer.forward(
                current, weight=weight, runtime_gather_output=True
            )
            logits = _vocab_parallel.mup_scaled(model, logits)
            out.append(logits.reshape(s, b, -1))
    return out


@contextlib.contextmanager
def _buffers_restored(module: torch.nn.Module) -> Iterator[None]:
    """Every buffer of ``module`` (MoE routers' token counts and expert bias) as it was before,
    also when the block raises."""
    saved = [(buffer, buffer.detach().clone()) for buffer in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)

"""What megatron's MTP loss reads from one forward call: its labels (or the input ids it
derives them from), loss mask, positions and packed sequences, found by name in the call's
arguments. ``+metrics`` and ``+objective`` both start from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import _capabilities


@dataclass
class Request:
    """What one forward hands to the figures (``_depth_figures.depth_values``) and the
    objectives: its phase and the arguments megatron's MTP loss reads."""

    phase: Any
    labels: torch.Tensor | None
    loss_mask: torch.Tensor | None
    input_ids: torch.Tensor | None
    packed_seq_params: Any
    runtime_gather_output: bool | None
    position_ids: torch.Tensor | None = None


def loss_request(
    model: Any, phase: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Request | None:
    """What megatron's MTP loss reads from this call of ``model``, or ``None`` where it
    computes none: no MTP or output layer on this pipeline stage, or no labels to take or
    derive."""
    if not getattr(model, "post_process", True) or getattr(model, "mtp", None) is None:
        return None
    bound = _capabilities.call_arguments(model, args, kwargs)
    labels, input_ids = bound.get("labels"), bound.get("input_ids")
    if labels is None and not (_capabilities.mtp_loss_derives_labels() and input_ids is not None):
        return None
    return Request(
        phase,
        labels,
        bound.get("loss_mask"),
        input_ids,
        bound.get("packed_seq_params"),
        bound.get("runtime_gather_output"),
        bound.get("position_ids"),
    )

"""NeMo-RL's MTP loss mask, computed from a training batch as NeMo-RL's Megatron worker does.

NeMo-RL (from its MTP training support, NVIDIA-NeMo/RL #2801) trains MTP on the tokens its
policy loss counts: the batch's ``token_mask`` (response tokens) times its ``sample_mask``
(samples that train), handed to the model as ``loss_mask``. :func:`mtp_loss_mask` gives the
same mask, with an option that #2801 describes and NeMo-RL's code does not have: MTP trained
only on samples whose advantage is positive, so the drafter learns the responses the policy
is moving towards.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mtp_hooks import PolicyError

if TYPE_CHECKING:
    import torch


def mtp_loss_mask(batch: Mapping[str, Any], *, positive_only: bool = False) -> torch.Tensor:
    """The MTP loss mask of a NeMo-RL training batch: ``token_mask * sample_mask``, and with
    ``positive_only`` only where ``advantages > 0`` too.

    Use it where a worker forms its microbatches, in an :func:`mtp_hooks.mtp_loss_mask`
    block around the microbatch's forward; the mask has the layout of the batch's tokens, so
    it fits a forward of those tokens unpacked and without context parallelism (NeMo-RL packs
    and slices its own mask where it passes one). Where NeMo-RL already passes its mask, a
    block multiplies with it, which for 0/1 masks changes nothing but the positive-only gate.

    Args:
        batch: A NeMo-RL ``BatchedDataDict`` or any mapping with ``token_mask`` ``[B, S]`` and
            ``sample_mask`` ``[B]``, and ``advantages`` (``[B, S]``, ``[B, 1]`` or ``[B]``) for
            ``positive_only``.
        positive_only: Keep only the tokens whose advantage is positive.

    Raises:
        mtp_hooks.PolicyError: A key is missing or its shape does not fit ``token_mask``,
            naming the key.

    Example:
        >>> import torch, mtp_hooks_nemo
        >>> batch = {
        ...     "token_mask": torch.tensor([[0, 1, 1], [0, 1, 1], [0, 0, 1]]),
        ...     "sample_mask": torch.tensor([1, 1, 0]),
        ...     "advantages": torch.tensor([[0.5, 0.5, 0.5], [-1.0, -1.0, -1.0], [2.0, 2.0, 2.0]]),
        ... }
        >>> mtp_hooks_nemo.mtp_loss_mask(batch).tolist()
        [[0.0, 1.0, 1.0], [0.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
        >>> mtp_hooks_nemo.mtp_loss_mask(batch, positive_only=True).tolist()
        [[0.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    """
    tokens = _key(batch, "token_mask")
    if tokens.dim() != 2:
        raise PolicyError(
            f"NeMo-RL batch: 'token_mask' must be [batch, seq], got shape {tuple(tokens.shape)}"
        )
    samples = _key(batch, "sample_mask")
    if tuple(samples.shape) != tuple(tokens.shape[:1]):
        raise PolicyError(
            f"NeMo-RL batch: 'sample_mask' has shape {tuple(samples.shape)}; 'token_mask' "
            f"{tuple(tokens.shape)} needs one entry per sample, {tuple(tokens.shape[:1])}"
        )
    mask = tokens.float() * samples.float().unsqueeze(-1)
    if positive_only:
        advantages = _key(batch, "advantages")
        given = tuple(advantages.shape)
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(-1)
        # Exactly [B], [B, 1] or [B, S]: a [B, S, 1] would broadcast to [B, S, S] where B == S.
        if advantages.dim() != 2 or tuple(advantages.shape) not in (
            (tokens.shape[0], 1),
            tuple(tokens.shape),
        ):
            raise PolicyError(
                f"NeMo-RL batch: 'advantages' has shape {given}; it must be [batch, seq], "
                f"[batch, 1] or [batch] for 'token_mask' {tuple(tokens.shape)}"
            )
        mask = mask * (advantages > 0).float()
    return mask


def _key(batch: Mapping[str, Any], key: str) -> torch.Tensor:
    import torch

    value = batch.get(key) if hasattr(batch, "get") else None
    if not isinstance(value, torch.Tensor):
        raise PolicyError(
            f"NeMo-RL batch: no tensor under {key!r} (got {type(value).__name__}); the MTP "
            "loss mask needs 'token_mask' and 'sample_mask', and 'advantages' for "
            "positive_only"
        )
    return value

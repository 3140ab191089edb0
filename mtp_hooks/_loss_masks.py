"""What the MTP loss trains on: per-call masks from plugins and from a context block.

megatron-core hands ``GPTModel.forward``'s ``loss_mask`` to the MTP loss only (and to an
``output_processor`` when one is given). A gated forward that runs MTP with labels collects the
masks of this call, from every plugin's ``mtp_loss_mask`` hook and from every enclosing
:func:`mtp_loss_mask` block, checks them, and passes their elementwise product, times the
caller's own ``loss_mask``, as that forward's ``loss_mask``. The language-model loss and the
logits are computed as without it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Union

from ._errors import PolicyError

if TYPE_CHECKING:
    import torch

# A block's mask, or a function that gives each forward's (the arguments of the hook
# mtp_loss_mask, by keyword) or None to abstain.
MaskSource = Union["torch.Tensor", Callable[..., Union["torch.Tensor", None]]]
# The open blocks of this thread or task, outermost first, each as a one-element list: a block
# that closes removes its own cell, found by identity, so blocks held by generators may close in
# any order and each still masks exactly the forwards inside it.
_CONTEXT: ContextVar[tuple[list[MaskSource], ...]] = ContextVar("mtp_hooks_loss_masks", default=())
CONTEXT = "the mtp_hooks.mtp_loss_mask block"
# How many blocks are open in all threads together: while none is, a forward that runs MTP
# skips looking up its own context (a list cell, read by index, is the cheapest test there is).
OPEN = [0]
_open_lock = threading.Lock()


@contextlib.contextmanager
def mtp_loss_mask(mask: MaskSource) -> Iterator[None]:
    """Train MTP only where ``mask`` says, in the forwards of attached models inside the block.

    The mask weighs the MTP loss per position, as megatron's ``loss_mask`` does: 0/1 or weights
    ``>= 0`` (bool, integer or floating), the shape of the forward's ``labels`` (of its
    ``input_ids`` where megatron derives the labels from them). It multiplies the caller's
    ``loss_mask`` and any plugin's ``mtp_loss_mask``; nested blocks multiply too. Only the MTP
    loss, its gradients and ``+metrics`` see it: the language-model loss and the logits are
    those of the same call without it. The block is per thread and per asyncio task
    (``contextvars``). Forwards that skip MTP, or have no labels to train it on, ignore it.

    Where the mask is known only inside a framework's step (its batch is pulled after the
    block opens), give a function instead: each forward that trains MTP calls it with the
    arguments of the ``mtp_loss_mask`` hook as keywords (``model``, ``phase``, ``loss_mask``,
    ``labels``, ``input_ids``), and it returns that forward's mask, or ``None`` to abstain.

    Args:
        mask: The per-position weights, or a function that gives them per forward.

    Raises:
        PolicyError: ``mask`` is neither a tensor nor callable, has a dtype other than bool,
            integer or floating, or holds a weight that is negative or not finite (checked
            here, which waits for the device once; a function's masks are checked at each
            forward). A shape or device that does not match a forward's labels is refused by
            that forward, before it changes anything.

    Example:
        .. code-block:: python

            response_only = (labels != -100) & (advantages > 0).unsqueeze(1)
            with mtp_hooks.mtp_loss_mask(response_only):
                loss = model(ids, pos, None, labels=labels)
    """
    if not callable(mask):
        _check_values(mask, CONTEXT)
    cell = [mask]
    with _open_lock:
        OPEN[0] += 1
    _CONTEXT.set((*_CONTEXT.get(), cell))
    try:
        yield
    finally:
        # Not ContextVar.reset: that would also drop blocks opened after this one and still
        # open, and bring back blocks closed since.
        _CONTEXT.set(tuple(c for c in _CONTEXT.get() if c is not cell))
        with _open_lock:
            OPEN[0] -= 1


def context_masks() -> tuple[MaskSource, ...]:
    """The masks (or mask functions) of the enclosing :func:`mtp_loss_mask` blocks, outermost
    first."""
    return tuple(cell[0] for cell in _CONTEXT.get())


def source_name(source: MaskSource) -> str:
    """Who gave a block's mask, for errors: the block, and its function where it has one."""
    if not callable(source):
        return CONTEXT
    name = getattr(source, "__qualname__", None) or type(source).__qualname__
    return f"{CONTEXT}'s function {name}"


def _check_type(mask: Any, by: str) -> None:
    import torch

    if not isinstance(mask, torch.Tensor):
        raise PolicyError(
            f"{by} gave {type(mask).__name__} as an MTP loss mask; give a tensor of weights "
            "(bool, integer or floating) the shape of the labels"
            + ("" if by != CONTEXT else ", or a function that returns one per forward")
        )


def _check_values(mask: Any, by: str) -> None:
    import torch

    _check_type(mask, by)
    if mask.is_complex() or mask.is_quantized:
        raise PolicyError(
            f"{by} gave an MTP loss mask of dtype {mask.dtype}; use bool, integer or floating"
        )
    if mask.dtype == torch.bool or mask.is_meta:  # a meta mask fails the forward's device check
        return
    bad = ~torch.isfinite(mask) | (mask < 0) if mask.is_floating_point() else mask < 0
    if bool(bad.any()):
        raise PolicyError(
            f"{by} gave an MTP loss mask with a negative or non-finite weight (first at index "
            f"{tuple(int(i) for i in bad.nonzero()[0])}); weights must be finite and >= 0"
        )


def check(mask: Any, by: str, like: torch.Tensor) -> torch.Tensor:
    """``mask``, checked to weigh the positions of ``like`` (the labels), as float32."""
    import torch

    _check_type(mask, by)
    if mask.shape != like.shape:
        raise PolicyError(
            f"{by} gave an MTP loss mask of shape {tuple(mask.shape)}; this forward's labels "
            f"have shape {tuple(like.shape)}"
        )
    if mask.device != like.device:
        raise PolicyError(
            f"{by} gave an MTP loss mask on {mask.device}; this forward's labels are on "
            f"{like.device}: move the mask there"
        )
    _check_values(mask, by)
    weights: torch.Tensor = mask.to(torch.float32)
    return weights

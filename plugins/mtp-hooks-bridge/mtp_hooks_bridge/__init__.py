"""mtp-hooks for Megatron-Bridge: MTP trains on the tokens that Bridge's own loss counts.

Megatron-Bridge's ``gpt_step.forward_step`` pulls a batch, hands the model its tokens and
labels, and keeps the batch's ``loss_mask`` for its own ``loss_func``: the model never sees it
(Megatron-Bridge issue #6103). megatron-core's MTP loss, which reads only the forward's
``loss_mask``, then counts every position, padding included, and in answer-only SFT the
prompt too. :func:`masked_forward_step` wraps a Bridge forward step, with no edit to Bridge,
so that each forward's MTP loss gets the ``loss_mask`` of the batch that step pulled:

.. code-block:: python

    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    import mtp_hooks_bridge

    pretrain(config, mtp_hooks_bridge.masked_forward_step(forward_step))

The language-model loss is Bridge's, unchanged. A Bridge that passes ``loss_mask`` to the
model itself (the fix proposed for #6103) is detected at each forward, and the wrapper then
adds nothing. The package registers no plugin: only a job that wraps its forward step changes.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar, cast

import mtp_hooks
from mtp_hooks import PolicyError

__all__ = ["LossMaskTap", "masked_forward_step"]

F = TypeVar("F", bound=Callable[..., Any])


def masked_forward_step(forward_step: F) -> F:
    """``forward_step``, with MTP trained on the ``loss_mask`` of the batch each call pulls.

    Each call wraps its ``data_iterator`` in a :class:`LossMaskTap` and runs ``forward_step``
    inside an :func:`mtp_hooks.mtp_loss_mask` block that asks the tap. The wrapper keeps
    ``forward_step``'s signature, which Bridge reads to decide whether to pass its
    ``GlobalState``, so it fits wherever ``forward_step`` did (``pretrain``, ``finetune``, or
    another Bridge step with a ``data_iterator`` parameter, such as ``forward_step_modelopt``).
    The model must be attached (``mtp_hooks.attach`` or ``MTP_HOOKS_AUTO=1``).

    Args:
        forward_step: A Bridge forward step: a callable with a ``data_iterator`` parameter
            whose model forward happens during the call.

    Raises:
        TypeError: ``forward_step`` has no ``data_iterator`` parameter (raised here, when
            wrapping, not in the first step).

    Example:
        >>> import mtp_hooks_bridge
        >>> def forward_step(state, data_iterator, model, return_schedule_plan=False):
        ...     batch = next(data_iterator)
        ...     return batch["tokens"], None
        >>> step = mtp_hooks_bridge.masked_forward_step(forward_step)
        >>> step(None, iter([{"tokens": 1, "loss_mask": None}]), None)
        (1, None)
        >>> import inspect
        >>> str(inspect.signature(step))
        '(state, data_iterator, model, return_schedule_plan=False)'
    """
    signature = inspect.signature(forward_step)
    if "data_iterator" not in signature.parameters:
        name = getattr(forward_step, "__qualname__", repr(forward_step))
        raise TypeError(
            f"mtp_hooks_bridge: {name}{signature} has no data_iterator parameter; wrap a "
            "Megatron-Bridge forward step such as gpt_step.forward_step"
        )

    @functools.wraps(forward_step)
    def step(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        tap = LossMaskTap(bound.arguments["data_iterator"])
        bound.arguments["data_iterator"] = tap
        with mtp_hooks.mtp_loss_mask(tap):
            return forward_step(*bound.args, **bound.kwargs)

    return cast(F, step)


class LossMaskTap:
    """An iterator over a forward step's batches that keeps the last batch's ``loss_mask``,
    and gives it, called as an :func:`mtp_hooks.mtp_loss_mask` function, to the forward.

    Bridge moves the batch's tensors to the GPU and, under context parallelism, slices them
    after pulling; the tap keeps the mask as pulled and moves it to the forward's device. A
    mask whose shape is not that of the forward's labels (context parallelism, or a step that
    reshapes its batch) is refused, naming the fix, before the forward changes anything.
    """

    __slots__ = ("_iterator", "_pulled", "_mask")

    def __init__(self, iterator: Any) -> None:
        self._iterator = iterator
        self._pulled = False
        self._mask: Any = None

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        batch = next(self._iterator)
        self._pulled = True
        self._mask = batch.get("loss_mask") if isinstance(batch, Mapping) else None
        return batch

    def __call__(
        self, *, model: Any, phase: Any, loss_mask: Any, labels: Any, input_ids: Any
    ) -> Any:
        """The mask for this forward, or ``None`` where the step passes ``loss_mask`` itself."""
        if loss_mask is not None:  # this Bridge hands the model its mask: nothing to add
            return None
        if not self._pulled:
            raise PolicyError(
                "mtp_hooks_bridge: the model ran MTP with labels before its forward step "
                "pulled a batch, so there is no loss_mask to train MTP on; wrap the step that "
                "pulls the batch the model trains on"
            )
        mask = self._mask
        if mask is None:
            raise PolicyError(
                "mtp_hooks_bridge: the batch this forward step pulled has no 'loss_mask'; "
                "masked_forward_step needs one (every Megatron-Bridge dataset gives it)"
            )
        import torch

        if not isinstance(mask, torch.Tensor):
            raise PolicyError(
                f"mtp_hooks_bridge: the batch this forward step pulled has a 'loss_mask' of "
                f"type {type(mask).__name__}; masked_forward_step needs a tensor the shape of "
                "the labels (0/1 or weights >= 0): give the dataset's mask as a tensor"
            )
        like = labels if labels is not None else input_ids
        if tuple(mask.shape) != tuple(like.shape):
            raise PolicyError(
                f"mtp_hooks_bridge: the batch's loss_mask has shape {tuple(mask.shape)}, this "
                f"forward's labels {tuple(like.shape)}. Megatron-Bridge slices a batch after "
                "pulling it under context parallelism (context_parallel_size > 1), and the "
                "tap cannot follow that; there, pass loss_mask to the model in your forward "
                "step instead (the change proposed for Megatron-Bridge issue #6103)"
            )
        return mask.to(like.device, non_blocking=True)

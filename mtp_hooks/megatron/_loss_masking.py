"""A forward's own MTP loss mask: collected, checked and handed to megatron as ``loss_mask``.

In megatron-core, ``GPTModel.forward``'s and ``HybridModel.forward``'s keyword ``loss_mask``
reaches the MTP loss (``process_mtp_loss``, which rolls it with the labels for each depth,
through packed sequences and context parallelism as it does for the caller's mask), and the
``output_processor`` when one is given. So a call whose masks are known gets, in its own
keyword arguments (a dict torch builds for each call), the product of those masks and the
caller's ``loss_mask``. Nothing on the model changes, so nothing needs restoring; a call that
is refused raises before its forward starts.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from .. import _loss_masks, _roles
from .._errors import UnsupportedModelError, about
from .._options import Mask
from .._plugin_registry import registry as _registry
from . import _capabilities, _refusals
from ._capabilities import call_arguments, mtp_loss_derives_labels, takes_loss_mask
from ._phase_counters import MASKED

if TYPE_CHECKING:
    from ._call_extensions import Extensions, PlannedCall


class LossMasks:
    """The per-call extension that sets a call's ``loss_mask`` (:mod:`._call_extensions`):
    begun where the plan masks (``+mask:labels``, plugins' masks) or a
    :func:`mtp_hooks.mtp_loss_mask` block is open. It changes only the call's own keyword
    arguments, so there is nothing to end."""

    ends: ClassVar[bool] = False

    def __init__(self, module: torch.nn.Module, extensions: Extensions) -> None:
        self.lock = extensions.lock

    def begin(
        self,
        module: torch.nn.Module,
        plan: PlannedCall,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        config: Any,
    ) -> None:
        """Set this call's ``loss_mask`` (:func:`apply`)."""
        apply(self.lock, module, plan, args, kwargs)

    def end(self, module: torch.nn.Module, output: Any) -> None:
        """Nothing to end: the mask went with the call's keyword arguments."""

    def cancel(self) -> None:
        """Nothing to drop."""

    def drop_all(self) -> None:
        """Nothing to drop."""


def apply(
    lock: threading.Lock,
    module: torch.nn.Module,
    plan: PlannedCall,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    """Set the ``loss_mask`` of this call of ``module``, which runs MTP under ``plan``,
    to the product of its masks: labels other than the plan's ignore index
    (``+mask:labels``), plugins' answers when the plan asks for them, the enclosing
    :func:`mtp_hooks.mtp_loss_mask` blocks (calling those given a function), and the caller's
    own; count it as masked.

    Raises:
        PolicyError: A mask of the wrong type, shape, device or values, naming who gave it.
        UnsupportedModelError: The call passes an ``output_processor``, which megatron would
            also hand the mask to, or the model's forward takes no ``loss_mask``.
    """
    with about(phase=str(plan.phase), role=_roles.role_of(module)):
        _apply(lock, module, plan, args, kwargs)


def _apply(
    lock: threading.Lock,
    module: torch.nn.Module,
    plan: PlannedCall,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    context = _loss_masks.context_masks()
    bound = call_arguments(module, args, kwargs)
    labels, input_ids = bound.get("labels"), bound.get("input_ids")
    like = labels if labels is not None else input_ids if mtp_loss_derives_labels() else None
    if like is None:  # megatron computes no MTP loss for this forward
        return
    caller = kwargs.get("loss_mask")
    answers: list[tuple[str, Any]] = []
    plugins: dict[str, str] = {}  # who gave a mask -> the plugin's name, for plugins' masks
    ignore = Mask.ignored(plan.options)
    if ignore is not None and labels is not None:  # derived labels have no ignore index
        answers.append(("the policy's +mask:labels", labels != ignore))
    if Mask.plugins_asked(plan.options, _registry().implements):
        given = _registry().loss_masks(
            module, plan.phase, loss_mask=caller, labels=labels, input_ids=input_ids
        )
        answers += [(f"plugin {name!r}", mask) for name, mask in given]
        plugins = {f"plugin {name!r}": name for name, _ in given}
    for source in context:
        if callable(source):  # a mask known only once the framework has its batch
            mask = source(
                model=module,
                phase=plan.phase,
                loss_mask=caller,
                labels=labels,
                input_ids=input_ids,
            )
            if mask is not None:
                answers.append((_loss_masks.source_name(source), mask))
        else:
            answers.append((_loss_masks.CONTEXT, source))
    if not answers:
        return
    if not _capabilities.guards_empty_mtp_masks():
        raise UnsupportedModelError(_refusals.UNGUARDED)
    if not takes_loss_mask(module):
        raise UnsupportedModelError(
            f"mtp_hooks: {type(module).__name__}.forward takes no loss_mask in this "
            "megatron-core, so an MTP loss mask cannot reach the MTP loss. Upgrade "
            "megatron-core, or drop the mtp_loss_mask plugin or block."
        )
    if kwargs.get("output_processor") is not None:
        raise UnsupportedModelError(
            "mtp_hooks: this forward passes an output_processor, and megatron hands it the "
            "forward's loss_mask too, so an MTP loss mask would change what it computes. Apply "
            "the mask inside your output_processor, or call without one."
        )
    masks = []
    for by, mask in answers:
        name = plugins.get(by)
        with about(plugin=name, hook=None if name is None else "mtp_loss_mask"):
            masks.append(_loss_masks.check(mask, by, like))
    product = masks[0]
    for mask in masks[1:]:
        product = product * mask
    if caller is not None:
        product = product * _loss_masks.check(caller, "the caller's loss_mask", like)
    kwargs["loss_mask"] = product
    with lock:  # the gate's: counters are shared by the calls of the phase
        plan.counters[MASKED] += 1

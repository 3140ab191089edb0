"""What the installed megatron-core can do, and what a given model is, detected without versions.

Every check here uses ``inspect.signature``, ``hasattr`` or an import that may fail; no version
string is ever parsed.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, cast

import torch

from .._errors import UnsupportedModelError
from . import _standalone

NATIVE_FLAG = "compute_mtp_loss"
GRAD_NORM_GROUP_ATTR = "grad_norm_group"  # what megatron's optimizer reads off a parameter


@functools.lru_cache(maxsize=1)
def language_model_classes() -> tuple[type, ...]:
    """The megatron-core model classes that can carry MTP: GPTModel, HybridModel, MambaModel."""
    classes: list[type] = []
    try:
        from megatron.core.models.gpt import GPTModel
    except ImportError as exc:
        raise UnsupportedModelError(
            "mtp_hooks.attach needs megatron-core; install it with "
            "pip install 'mtp-hooks[megatron]'"
        ) from exc
    classes.append(GPTModel)
    try:
        from megatron.core.models.hybrid.hybrid_model import HybridModel

        classes.append(HybridModel)
    except ImportError:
        pass
    try:
        from megatron.core.models.mamba import MambaModel

        classes.append(MambaModel)
    except ImportError:
        pass
    return tuple(classes)


@functools.cache
def native_flag(cls: Any) -> bool:
    """Whether ``cls.forward`` takes the native ``compute_mtp_loss`` keyword (Megatron-LM main)."""
    return NATIVE_FLAG in inspect.signature(cls.forward).parameters


@functools.cache
def inference_arguments(cls: Any) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The inference-context arguments of ``cls.forward``: their names, and the positional
    indices (after ``self``) of those that can be passed by position."""
    params = list(inspect.signature(cls.forward).parameters.values())[1:]
    names, positions = [], []
    for i, p in enumerate(params):
        if p.name in ("inference_context", "inference_params"):
            names.append(p.name)
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                positions.append(i)
    return tuple(names), tuple(positions)


def tied_mtp_stage(model: Any) -> bool:
    """An MTP pipeline stage without ``pre_process`` whose output layer ties to the embedding:
    there, turning ``mtp_process`` off switches the logits to another weight. (A standalone MTP
    stage has no output layer, and a standalone layout's loss stage no MTP block, so
    ``mtp_process`` is off there already.)"""
    return (
        bool(getattr(model, "mtp_process", False))
        and not getattr(model, "pre_process", True)
        and getattr(model, "post_process", True)
        and bool(getattr(model, "share_embeddings_and_output_weights", False))
    )


def mtp_only_parameters(model: Any) -> list[tuple[str, torch.nn.Parameter]]:
    """``mtp.*`` parameters, plus the embedding copy on an MTP stage without ``pre_process``
    (none on a stage without an MTP block, such as a standalone MTP stage's loss stage)."""
    if getattr(model, "mtp", None) is None:
        return []
    params = [(f"mtp.{n}", p) for n, p in model.mtp.named_parameters()]
    if not getattr(model, "pre_process", True) and hasattr(model, "embedding"):
        params += [(f"embedding.{n}", p) for n, p in model.embedding.named_parameters()]
    return params


def gated(model: Any) -> bool:
    """Whether a gate goes on this rank's model: it runs MTP, or computes a standalone MTP
    stage's losses."""
    return has_mtp(model) or _standalone.loss_stage(model)


@functools.lru_cache(maxsize=64)
def labels_position(cls: Any) -> int | None:
    """The positional index (after ``self``) of ``labels`` in ``cls.forward``, if it has one."""
    params = list(inspect.signature(cls.forward).parameters.values())[1:]
    for i, p in enumerate(params):
        if p.name == "labels" and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            return i
    return None


@functools.lru_cache(maxsize=64)
def positional_names(cls: Any) -> tuple[str, ...]:
    """The names of ``cls.forward``'s parameters that a call can pass by position, after
    ``self``, in order: how a :class:`~mtp_hooks.ForwardCall` names positional arguments."""
    params = list(forward_signature(cls).parameters.values())[1:]
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in kinds)


def inference_call(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this call of ``model`` is an inference forward: megatron's ``InferenceMode`` is
    active, or an inference context is passed (by name or by position)."""
    mode = inference_mode_class()
    if mode is not None and mode.is_active():
        return True
    cls: Any = type(model)  # a class is hashable; mypy reads type[Any] as maybe not
    names, positions = inference_arguments(cls)
    if any(kwargs.get(name) is not None for name in names):
        return True
    return any(index < len(args) and args[index] is not None for index in positions)


@functools.lru_cache(maxsize=1)
def inference_mode_class() -> Any:
    """megatron's process-wide ``InferenceMode`` (0.18+, with ``is_active()``), else ``None``."""
    try:
        from megatron.core.inference.utils import InferenceMode
    except ImportError:
        return None
    return InferenceMode if hasattr(InferenceMode, "is_active") else None


@functools.lru_cache(maxsize=1)
def mtp_grad_norm_group() -> str | None:
    """The gradient-norm group megatron's optimizer clips apart from the rest for MTP weights
    (``'mtp'`` in 0.19, read from ``megatron.core.optimizer.optimizer``), or ``None`` where the
    optimizer has no separate groups."""
    try:
        from megatron.core.optimizer import optimizer
    except ImportError:
        return None
    group = getattr(optimizer, "MTP_GRAD_NORM_GROUP", None)
    return group if group in getattr(optimizer, "SEPARATE_GRAD_NORM_GROUPS", ()) else None


@functools.lru_cache(maxsize=1)
def guards_empty_mtp_masks() -> bool:
    """Whether this megatron-core's MTP loss survives a mask that leaves a depth no position:
    ``process_mtp_loss`` (0.18 on) clamps the count it divides by; 0.16 divides by zero."""
    try:
        from megatron.core.transformer import multi_token_prediction
    except ImportError:
        return False
    return hasattr(multi_token_prediction, "process_mtp_loss")


def untagged_mtp_parameters(model: Any, group: str) -> list[str]:
    """The names of the parameters of ``model.mtp`` outside gradient-norm group ``group``."""
    block = getattr(model, "mtp", None)
    if block is None:
        return []
    return [
        f"mtp.{name}"
        for name, param in block.named_parameters()
        if getattr(param, GRAD_NORM_GROUP_ATTR, None) != group
    ]


def detach_readers(model: Any) -> tuple[torch.nn.Module, ...]:
    """The MTP modules that read ``mtp_detach_heads`` from their own ``config`` in forward:
    the MTP block (the trunk's hidden states) and each MTP layer (the embeddings).
    ``process_mtp_loss`` (the output weight) reads the model's."""
    block = getattr(model, "mtp", None)
    if block is None:
        return ()
    layers = getattr(block, "layers", None) or ()
    return tuple(m for m in (block, *layers) if hasattr(m, "config"))


def has_mtp(model: Any) -> bool:
    """Whether this rank's model runs an MTP block (``mtp_process`` and ``mtp_num_layers``)."""
    config = getattr(model, "config", None)
    return bool(getattr(model, "mtp_process", False)) and bool(
        getattr(config, "mtp_num_layers", None)
    )


def unwrap(model: Any) -> tuple[list[torch.nn.Module], list[torch.nn.Module]]:
    """Find the language models inside ``model``.

    Args:
        model: A GPTModel/HybridModel, a wrapper with a ``.module`` chain (Megatron DDP,
            Float16Module, torch DDP), or a list/tuple of virtual-pipeline chunks.

    Returns:
        ``(language models, wrappers seen on the way)``.

    Raises:
        UnsupportedModelError: Naming the supported types, or refusing a compiled model.
    """
    classes = language_model_classes()
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if not chunks:
        raise UnsupportedModelError("mtp_hooks.attach: got an empty list of model chunks")
    found: list[Any] = []
    wrappers: list[Any] = []
    for chunk in chunks:
        obj: Any = chunk
        while not isinstance(obj, classes):
            if hasattr(obj, "_orig_mod"):
                raise UnsupportedModelError(
                    "mtp_hooks.attach: got a torch.compile'd model. dynamo does not see hooks "
                    "added to a model it has already traced, so the policy would not apply: "
                    "attach the model itself, then compile its forward "
                    "(model.forward = torch.compile(model.forward), which leaves the hooks "
                    "outside dynamo, so it may come before or after attach) or the module "
                    "(model = torch.compile(model) after mtp_hooks.attach(model))."
                )
            inner = getattr(obj, "module", None)
            if not isinstance(inner, torch.nn.Module):
                names = ", ".join(c.__name__ for c in classes)
                raise UnsupportedModelError(
                    f"mtp_hooks.attach: {type(chunk).__name__} is not supported; pass a "
                    f"megatron-core {names}, a wrapper of one with a .module chain (Megatron DDP, "
                    "Float16Module, torch DDP), or a list of virtual-pipeline chunks"
                )
            wrappers.append(obj)
            obj = inner
        if not any(obj is seen for seen in found):  # a chunk given twice is gated once
            found.append(obj)
    return found, wrappers


@functools.lru_cache(maxsize=1)
def mtp_loss_derives_labels() -> bool:
    """Whether this Megatron computes the MTP loss from ``input_ids`` when labels are None."""
    from megatron.core.transformer import multi_token_prediction

    process = getattr(multi_token_prediction, "process_mtp_loss", None)
    return process is not None and "input_ids" in inspect.signature(process).parameters


@functools.cache
def forward_signature(cls: Any) -> inspect.Signature:
    """The signature of the nearest ``forward`` in ``cls``'s MRO that names ``labels``: a
    subclass's ``forward(*args, flag=..., **kwargs)`` passes its arguments to megatron's."""
    for klass in cls.__mro__:
        forward = klass.__dict__.get("forward")
        if forward is not None and "labels" in inspect.signature(forward).parameters:
            return inspect.signature(forward)
    return inspect.signature(cls.forward)


def call_arguments(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The named arguments of one call of ``model``'s forward (those the signature names)."""
    signature = forward_signature(cast(Any, type(model)))  # a class: hashable
    named = {k: v for k, v in kwargs.items() if k in signature.parameters}
    return signature.bind_partial(model, *args, **named).arguments


def takes_loss_mask(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forward names a ``loss_mask``."""
    return "loss_mask" in forward_signature(cast(Any, type(model))).parameters


def full_graph_wrapper() -> Any | None:
    """megatron's ``FullCudaGraphWrapper`` class, if it can drop a captured graph."""
    try:
        from megatron.core.full_cuda_graph import FullCudaGraphWrapper
    except ImportError:
        return None
    return FullCudaGraphWrapper if hasattr(FullCudaGraphWrapper, "reset_cuda_graph") else None


def has_detach_field(config: Any) -> bool:
    """Whether this megatron-core's ``TransformerConfig`` has ``mtp_detach_heads`` (0.19 on),
    the field each forward is told to detach MTP's inputs through; ``config`` is a config or
    its class."""
    cls = config if isinstance(config, type) else type(config)
    return "mtp_detach_heads" in getattr(cls, "__dataclass_fields__", ())


def drafts_single_positions(model: Any) -> bool:
    """Whether ``model``'s MTP layers have megatron-core's ``forward_single_position`` (0.17
    on): one draft position at a time, as the inference engine computes them."""
    layers: Any = getattr(getattr(model, "mtp", None), "layers", None)
    return bool(layers) and callable(getattr(layers[0], "forward_single_position", None))

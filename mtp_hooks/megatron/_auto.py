"""Auto-attach: gate every MTP-carrying model built in this process, without calling ``attach``.

One process-wide *module registration* hook (torch's public
``register_module_module_registration_hook``) sees each ``self.x = submodule`` while modules are
built. It costs nothing at forward time and looks at two names only:

* ``mtp`` assigned on a ``GPTModel``/``HybridModel``/``MambaModel``: the model carries MTP on this
  rank. It gets a one-shot forward pre-hook that attaches it at its first forward, when its
  construction and any wrapping are complete.
* ``module`` assigned on any module, where the submodule is such a model or a wrapper of one:
  a DDP/Float16Module wrapper. The first-forward attach goes through the outermost wrapper, so
  the DDP remedies apply. A wrapper built after the model's first forward re-attaches it.

Models without MTP on this rank never get a hook. The registries live on the runtime
(``_runtime.process.auto``), held weakly.
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any

import torch

from .. import _runtime
from .._errors import MTPHooksError, UnsupportedModelError
from . import _attach, _call_stack, _capabilities, _freezing, _gate


def enable(enabled: bool = True, *, clip_mtp_apart: bool = False) -> None:
    """Start (or with ``False`` stop) watching for new models; see ``mtp_hooks.auto_attach``."""
    auto = _runtime.process.auto
    if clip_mtp_apart and enabled:
        _freezing.mtp_grad_norm_group_or_refuse()  # refused now, changing nothing, if none
    auto.clip_mtp_apart = bool(clip_mtp_apart and enabled)
    if enabled and auto.registration is None:
        register = torch.nn.modules.module.register_module_module_registration_hook
        auto.registration = register(_on_registration)
    elif not enabled and auto.registration is not None:
        auto.registration.remove()
        auto.registration = None


def _on_registration(parent: torch.nn.Module, name: str, child: torch.nn.Module) -> None:
    auto = _runtime.process.auto
    if name == "mtp":
        if (
            isinstance(parent, _capabilities.language_model_classes())
            and parent not in auto.watchers
        ):
            if auto.clip_mtp_apart and _capabilities.has_mtp(parent):
                # The block is built (``parent.mtp`` is set once this hook returns), and no
                # wrapper or optimizer exists yet.
                _freezing.clip_mtp_apart_parameters([], [], blocks=(child,))
            _watch(parent)
    elif name == "module" and (
        child in auto.watchers or child in auto.wrappers or child in auto.handles
    ):
        auto.parents[child] = weakref.ref(parent)
        auto.wrappers.add(parent)
        for model in _models_below(child):
            handle = auto.handles.pop(model, None)
            if handle is not None:  # wrapped after its first forward: attach again through it
                handle.remove()
                _watch(model)


def _watch(model: torch.nn.Module) -> None:
    _runtime.process.auto.watchers[model] = model.register_forward_pre_hook(
        _first_forward, with_kwargs=True, prepend=True
    )


def _first_forward(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
) -> Any:
    """Attach ``model`` through its outermost wrapper, then gate this very call; where dynamo
    traces this call (``torch.compile``), outside its graphs, as the gate's own hooks do."""
    if kwargs is None:  # torch listed this hook, then another thread's first forward removed it
        if _gated_by_its_own_hook(model, None):
            return None
        raise MTPHooksError(
            "mtp_hooks auto-attach: this model's first forward began in two threads at once, "
            "and the other thread attached the model after this thread's forward had begun, "
            "so this forward cannot be gated. Run one forward of the model before its threads "
            "start, or attach it with mtp_hooks.attach(model) before then."
        )
    if _gate.is_compiling():
        return _first_forward_eagerly(model, args, kwargs)
    return _attach_and_gate(model, args, kwargs, sys._getframe(1))


@torch.compiler.disable  # type: ignore[untyped-decorator]
def _first_forward_eagerly(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """:func:`_first_forward`, run outside dynamo's graphs."""
    caller = _gate.traced_hooks_caller("_first_forward", __file__)
    return _attach_and_gate(model, args, kwargs, caller)


def _attach_and_gate(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], caller: Any
) -> Any:
    """The work of :func:`_first_forward`; ``caller``: the frame running the model's call.

    An inference forward (a rollout engine's) leaves the model unattached until its first
    forward that is not one: inference forwards are never gated, and megatron's RL loop sets
    inference-only settings (local CUDA graphs) on the model's config while its engine runs, so
    attach-time checks would read settings the model never trains under. A refusal raised
    there would also surface inside the engine's event loop, which stops it and leaves the
    trainer waiting for rollouts forever.
    """
    if _capabilities.inference_call(model, args, kwargs):
        return None
    auto = _runtime.process.auto
    with auto.lock:  # one first forward attaches; another thread's waits for it, then is gated
        handle = auto.handles.get(model)
        if handle is None:
            watcher = auto.watchers.get(model)
            if watcher is None:  # no longer watched: another thread's attach was refused
                return None
            # attach before the watcher goes, so that a call listing neither never starts
            handle = auto.handles[model] = _attach_outermost(model, auto)
            del auto.watchers[model]
            watcher.remove()
        gate = next((g for g in handle.gates if g.model is model), None)
        if gate is None or _gated_by_its_own_hook(model, kwargs):
            return None
    # The new pre-hook missed this call (torch iterates a snapshot); its post-hook will run.
    return gate.pre_hook(model, args, kwargs, caller)


def _gated_by_its_own_hook(model: torch.nn.Module, kwargs: dict[str, Any] | None) -> bool:
    """Whether the gate's own pre-hook, which torch listed with this one, has already taken
    this thread's call of ``model`` (its record holds ``kwargs``; any, where torch passed none)."""
    handle = _runtime.process.auto.handles.get(model)
    thread = threading.get_ident()
    return handle is not None and any(
        record[_call_stack.THREAD] == thread
        and (kwargs is None or record[_call_stack.KWARGS] is kwargs)
        for gate in handle.gates
        if gate.model is model
        for record in list(gate.records)
    )


def _attach_outermost(model: torch.nn.Module, auto: Any) -> Any:
    """Attach ``model`` through the outermost wrapper built around it."""
    outer = model
    while (ref := auto.parents.get(outer)) is not None and (parent := ref()) is not None:
        outer = parent
    try:
        return _attach.attach(outer)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(
            f"{exc} (this model was attached automatically because MTP_HOOKS_AUTO or "
            "mtp_hooks.auto_attach() is on; turn it off for this process to run it ungated)",
            **exc.culprit(),
        ) from exc


def _models_below(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The language model inside a ``.module`` chain, as attach finds it; none for others."""
    try:
        return _capabilities.unwrap(module)[0]
    except UnsupportedModelError:
        return []

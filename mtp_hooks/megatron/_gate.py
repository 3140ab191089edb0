"""The per-model gate: a forward pre-hook that applies a decision and a forward hook that undoes it.

For one forward call of a ``GPTModel``/``HybridModel`` whose decision is *skip*, the gate either
passes the native ``compute_mtp_loss=False`` keyword, or turns off the two instance gates
Megatron reads: ``model.mtp_process`` and ``model.config.mtp_num_layers`` (through a shallow copy
of the config, never the shared object). The forward hook, registered first and with
``always_call=True``, restores both before anything else, also when forward raises.

Each call pushes exactly one frame, so nested and re-entrant forwards restore in LIFO order.

The gates are written with ``object.__setattr__``: both are plain instance attributes (never
parameters, buffers or submodules), for which ``nn.Module.__setattr__`` ends in exactly that
call after its isinstance checks; skipping those checks halves the per-call cost.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import torch

from .. import _decision, _phases
from .._errors import UnsupportedModelError
from . import _capabilities, _distributed

__all__ = ["MTPGate"]

# A frame is (restore, mtp_process, config, skipped).
_NOTHING = (False, None, None, False)
_NATIVE_SKIP = (False, None, None, True)


class MTPGate:
    """Consults the policy at every forward of one language model and gates its MTP block."""

    def __init__(self, model: torch.nn.Module, wrappers: list[torch.nn.Module], verify: bool):
        self.model = model
        self.cls = type(model)
        self.native = _capabilities.native_flag(self.cls)
        self.tied_hazard = (
            not self.native
            and not getattr(model, "pre_process", True)
            and bool(getattr(model, "share_embeddings_and_output_weights", False))
        )
        self.verify = verify
        self.wrappers = wrappers
        self.megatron_ddps = _distributed.megatron_ddps(wrappers)
        self.torch_ddp = any(
            isinstance(w, torch.nn.parallel.DistributedDataParallel) for w in wrappers
        )
        self.mtp_params = _distributed.mtp_only_parameters(model)
        self.param_gather_groups = _distributed.mtp_param_gather_groups(
            self.megatron_ddps, self.mtp_params
        )
        self.frames: list[tuple[bool, Any, Any, bool]] = []
        self.base: tuple[Any, Any] = (model.mtp_process, model.config)
        self.counts: Counter[tuple[str, str]] = Counter()
        self.last_run: bool | None = None
        impl = getattr(model.config, "cuda_graph_impl", "none")
        self.cuda_graphs = impl in ("local", "transformer_engine") or bool(
            getattr(model.config, "enable_cuda_graph", False)
        )
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        _distributed.refuse_unsupported_config(model.config)

    # -- hook registration -------------------------------------------------------------------
    def install(self) -> None:
        """Register the two hooks on the model, ahead of any other hook of the model."""
        self.handles = [
            self.model.register_forward_pre_hook(self.pre_hook, with_kwargs=True, prepend=True),
            self.model.register_forward_hook(
                self.post_hook, with_kwargs=True, always_call=True, prepend=True
            ),
        ]

    def remove(self) -> None:
        """Remove both hooks; restores the gates too if called in the middle of a forward."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if self.frames:
            _set(self.model, "mtp_process", self.base[0])
            _set(self.model, "config", self.base[1])
            self.frames.clear()

    # -- the hooks -----------------------------------------------------------------------------
    def pre_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        """Decide for this call and apply it; returns new ``(args, kwargs)`` only for the flag.

        Raises:
            UnsupportedModelError: A skip that cannot be done safely; nothing is changed then.
        """
        self.frames.append(_NOTHING)  # popped by post_hook even if anything below raises
        if _capabilities.inference_mode_active() or _capabilities.has_inference_context(
            self.cls, args, kwargs
        ):
            self.counts[("inference", "untouched")] += 1
            return None
        if torch.compiler.is_compiling():
            raise UnsupportedModelError(
                "mtp_hooks: a gated model is running under torch.compile, where forward hooks "
                "with always_call=True do not run when forward raises. Run it uncompiled, or "
                "mtp_hooks.detach() it first."
            )
        if len(self.frames) == 1:
            self.base = (module.mtp_process, module.config)
        base_mtp_process, base_config = self.base
        if not base_mtp_process or not getattr(base_config, "mtp_num_layers", None):
            return None  # MTP already off for this model (by someone else): nothing to decide
        phase = _phases.current_phase()
        if phase is None:
            training = module.training and torch.is_grad_enabled()
            phase = _phases.Phase.TRAIN if training else _phases.Phase.EVAL
        decision = _decision.decide(module, phase)
        if self.verify:
            _distributed.verify_agreement(decision, phase)
        if self.cuda_graphs:
            self._check_cuda_graphs(decision.run)
        key = phase.value if isinstance(phase, _phases.Phase) else phase
        if decision.run:
            self.counts[(key, "run")] += 1
            if module.mtp_process is base_mtp_process and module.config is base_config:
                return None
            self.frames[-1] = (True, module.mtp_process, module.config, False)
            _set(module, "mtp_process", base_mtp_process)
            _set(module, "config", base_config)
            return None
        if (
            self.mtp_params
            and not self.megatron_ddps
            and hasattr(self.mtp_params[0][1], "main_grad")
        ):
            raise UnsupportedModelError(
                "mtp_hooks: this model's MTP parameters are in a Megatron DDP gradient buffer, "
                "but mtp_hooks was attached to the bare model, so a skipped forward cannot "
                "settle DDP's param all-gathers (with overlap_param_gather=True the next step "
                "fails on 'param_gather_handle is None'). Attach the DDP wrapper instead: "
                "mtp_hooks.attach(ddp_model), or freeze MTP with mtp_hooks.freeze_mtp() before "
                "wrapping."
            )
        if self.native:
            self.counts[(key, "skip")] += 1
            self.frames[-1] = _NATIVE_SKIP
            return args, {**kwargs, _capabilities.NATIVE_FLAG: False}
        if self.tied_hazard:
            raise UnsupportedModelError(
                "mtp_hooks: cannot skip MTP on this pipeline stage: it has MTP, no pre_process "
                "and share_embeddings_and_output_weights=True, and this megatron-core has no "
                "native compute_mtp_loss flag. Turning mtp_process off would switch the output "
                "layer to an unsynced weight and silently change the loss. Use a policy that "
                "runs MTP here, set share_embeddings_and_output_weights=False, or upgrade to a "
                "megatron-core whose HybridModel.forward accepts compute_mtp_loss."
            )
        self.counts[(key, "skip")] += 1
        self.frames[-1] = (True, module.mtp_process, module.config, True)
        _set(module, "mtp_process", False)
        _set(module, "config", config_without_mtp(base_config))
        return None

    def post_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        """Restore this call's gates first; then settle DDP state after a completed skip."""
        restore, mtp_process, config, skipped = self.frames.pop() if self.frames else _NOTHING
        if restore:
            _set(module, "mtp_process", mtp_process)
            _set(module, "config", config)
        if skipped and output is not None:
            return _distributed.after_skipped_forward(self, output)
        return None

    # -- helpers -------------------------------------------------------------------------------
    def _check_cuda_graphs(self, run: bool) -> None:
        """Refuse a decision that differs from the last one on a model with CUDA graphs."""
        if self.last_run is not None and self.last_run != run:
            impl = getattr(self.base[1], "cuda_graph_impl", "local")
            raise UnsupportedModelError(
                f"mtp_hooks: the MTP decision changed from {'run' if self.last_run else 'skip'}"
                f" to {'run' if run else 'skip'} on a model with CUDA graphs "
                f"(cuda_graph_impl={impl!r}); a graph recorded one way fails the other way "
                "('no matching cudagraph runners'). Keep the policy constant for this model, "
                "or set cuda_graph_impl='none'."
            )
        self.last_run = run

    def stats(self) -> dict[str, dict[str, int]]:
        """Counts of runs, skips and untouched (inference) calls, by phase."""
        out: dict[str, dict[str, int]] = {}
        for (phase, what), n in sorted(self.counts.items()):
            out.setdefault(phase, {})[what] = n
        return out


_set = object.__setattr__


def config_without_mtp(config: Any) -> Any:
    """A fresh shallow copy of ``config`` with ``mtp_num_layers=None``.

    Like ``copy.copy`` (no ``__init__``/``__post_init__``, so no re-validation), at half the cost
    for a plain dataclass; classes with ``__slots__`` or ``__copy__`` go through ``copy.copy``.
    """
    cls = type(config)
    state = getattr(config, "__dict__", None)
    if state is None or hasattr(cls, "__copy__"):
        new = copy.copy(config)
    else:
        new = object.__new__(cls)
        new.__dict__.update(state)
    new.mtp_num_layers = None
    return new

"""The per-model gate: a forward pre-hook that applies a decision and a forward hook that undoes it.

For one forward call of a ``GPTModel``/``HybridModel`` whose decision is *skip*, the gate either
passes the native ``compute_mtp_loss=False`` keyword, or turns off the two instance gates
Megatron reads: ``model.mtp_process`` and ``model.config.mtp_num_layers`` (through a shallow copy
of the config, never the shared object). The forward hook, registered first and with
``always_call=True``, restores both before anything else, also when forward raises.

Every call pushes one :class:`_Frame` naming the interpreter frame that runs it (torch's own
hook-calling frame, alive exactly as long as the call). That makes three things decidable:

* **Interrupted calls.** torch runs ``always_call`` hooks for ``Exception`` only, so a
  ``KeyboardInterrupt`` or ``SystemExit`` leaves a frame whose caller is gone. The next forward
  of the model, ``remove()`` and ``detach()`` find it and restore the gates first.
* **Threads.** Frames carry their thread. A call that would change the shared gates while
  another thread's forward of the same model is running raises instead of swapping decisions.
* **Removal from inside a forward.** ``remove()`` then leaves the restoring hook in place
  until the running calls have returned, so each forward completes in one consistent state.

The gates are written with ``object.__setattr__``: both are plain instance attributes (never
parameters, buffers or submodules), for which ``nn.Module.__setattr__`` ends in exactly that
call after its isinstance checks.
"""

from __future__ import annotations

import copy
import sys
import threading
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any, NamedTuple

import torch

from .. import _decision, _phases, _policy, _roles
from .._errors import MTPHooksError, UnsupportedModelError
from . import _capabilities, _distributed


class _Frame(NamedTuple):
    """One running (or interrupted) forward call of the gated model."""

    thread: int
    owner: FrameType | None  # the interpreter frame that called the pre-hook; None: always stale
    restore: tuple[Any, Any] | None  # (mtp_process, config) to put back, or None
    skipped: bool


class MTPGate:
    """Consults the policy at every forward of one language model and gates its MTP block."""

    def __init__(self, model: torch.nn.Module, ddp: _distributed.DDPState, verify: bool):
        self._model = weakref.ref(model)
        self.cls = type(model)
        self.native = _capabilities.native_flag(self.cls)
        self.inference_args = _capabilities.inference_arg_index(self.cls)
        self.tied_hazard = (
            not self.native
            and not getattr(model, "pre_process", True)
            and bool(getattr(model, "share_embeddings_and_output_weights", False))
        )
        self.verify = verify
        self.ddp = ddp
        self.base: tuple[Any, Any] = (model.mtp_process, model.config)
        impl = getattr(model.config, "cuda_graph_impl", "none")
        self.cuda_graphs = impl in ("local", "transformer_engine") or bool(
            getattr(model.config, "enable_cuda_graph", False)
        )
        _distributed.refuse_unsupported_config(model.config)
        self.frames: list[_Frame] = []
        self.counts: dict[tuple[str, str], int] = {}
        self.cache: dict[Any, tuple[int, _decision.Decision]] = {}
        self.last_run: bool | None = None
        self.lock = threading.Lock()
        self.removed = False
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        self.on_copy: Callable[[MTPGate], None] | None = None  # set by attach: adopt a deepcopy

    @property
    def model(self) -> torch.nn.Module | None:
        """The gated model, or ``None`` once it has been garbage-collected."""
        return self._model()

    # -- hook registration -------------------------------------------------------------------
    def install(self) -> None:
        """Register the two hooks on the model, ahead of any other hook of the model."""
        model = self._model()
        assert model is not None
        self.handles = [
            model.register_forward_pre_hook(self.pre_hook, with_kwargs=True, prepend=True),
            model.register_forward_hook(
                self.post_hook, with_kwargs=True, always_call=True, prepend=True
            ),
        ]

    def remove(self) -> None:
        """Remove both hooks and restore the gates.

        Called while a forward of the model runs (from a plugin, a submodule hook or another
        thread), it removes the pre-hook now and leaves the restoring hook until that forward
        returns, so no forward sees the gates flip half-way.
        """
        with self.lock:
            self.removed = True
            if self.handles:
                self.handles[0].remove()
            model = self._model()
            if model is not None:
                self._prune(model, None)
            if not self.frames:
                for handle in self.handles[1:]:
                    handle.remove()
                self.handles = []

    # -- the hooks -----------------------------------------------------------------------------
    def pre_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        """Decide for this call and apply it; returns new ``(args, kwargs)`` only for the flag.

        Raises:
            UnsupportedModelError: A skip that cannot be done safely; nothing is changed then.
            MTPHooksError: Another thread runs this model with gates this call must change.
        """
        return self.before_forward(module, args, kwargs, sys._getframe(1))

    def before_forward(
        self, module: torch.nn.Module, args: tuple, kwargs: dict, owner: FrameType
    ) -> Any:
        """:meth:`pre_hook` for a call run by the interpreter frame ``owner``."""
        if self.frames:  # a running call (nesting, another thread) or an interrupted one
            with self.lock:
                self._prune(module, None)
        key, run = self._consult(module, args, kwargs)
        with self.lock:
            if self.removed:  # a plugin removed the gate while deciding: leave this call alone
                return None
            return self._apply(module, owner, key, run, args, kwargs)

    def post_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        """Restore this call's gates first; then settle DDP state after a completed skip."""
        caller = sys._getframe(1)
        with self.lock:
            frames = self.frames
            if frames and frames[-1].owner is caller:
                frame: _Frame | None = frames.pop()
            else:  # forward raised (caller is torch's exception handler) or threads interleave
                frame = self._pop_own(caller)
                self._prune(module, caller)
            if frame is not None and frame.restore is not None:
                _set(module, "mtp_process", frame.restore[0])
                _set(module, "config", frame.restore[1])
            if self.removed and not frames:
                for handle in self.handles:
                    handle.remove()
                self.handles = []
        if frame is not None and frame.skipped and output is not None:
            return self.ddp.after_skipped_forward(output)
        return None

    # -- deciding ------------------------------------------------------------------------------
    def _consult(
        self, module: torch.nn.Module, args: tuple, kwargs: dict
    ) -> tuple[str, bool | None]:
        """The phase key and decision for this call; ``None`` leaves the call untouched."""
        if _capabilities.inference_mode_active() or _capabilities.has_inference_context(
            self.inference_args, args, kwargs
        ):
            return "inference", None
        if torch.compiler.is_compiling():
            raise UnsupportedModelError(
                "mtp_hooks: a gated model is running under torch.compile, where forward hooks "
                "with always_call=True do not run when forward raises. Run it uncompiled, or "
                "mtp_hooks.detach() it first."
            )
        base_mtp_process, base_config = self.base if self.frames else _current(module)
        if not base_mtp_process or not getattr(base_config, "mtp_num_layers", None):
            return "", None  # MTP already off for this model (by someone else): nothing to decide
        phase = _phases.current_phase()
        if phase is None:
            training = module.training and torch.is_grad_enabled()
            phase = _phases.Phase.TRAIN if training else _phases.Phase.EVAL
        generation = _policy.generation()
        cached = self.cache.get(phase)
        if cached is not None and cached[0] == generation:
            decision = cached[1]
        else:
            role = _roles.role_of(module)
            decision, cacheable = _decision.decide_normalized(module, phase, role)
            if cacheable:
                self.cache[phase] = (generation, decision)
        if self.verify:
            _distributed.verify_agreement(decision, phase)
        if self.cuda_graphs:
            self._check_cuda_graphs(decision.run)
        return str(phase), decision.run

    def _apply(
        self,
        module: torch.nn.Module,
        owner: FrameType,
        key: str,
        run: bool | None,
        args: tuple,
        kwargs: dict,
    ) -> Any:
        """Push this call's frame and set the gates (under the lock)."""
        thread = threading.get_ident()
        if not self.frames:
            self.base = _current(module)
        if run is None:
            if key:
                self._count(key, "untouched")
            self.frames.append(_Frame(thread, owner, None, False))
            return None
        base = self.base
        current = _current(module)
        toggled = current[0] is not base[0] or current[1] is not base[1]
        if run:
            if toggled and self._other_thread(thread):
                self._refuse_concurrent(module, "run")
            self._count(key, "run")
            restore = current if toggled else None
            if toggled:
                _set(module, "mtp_process", base[0])
                _set(module, "config", base[1])
            self.frames.append(_Frame(thread, owner, restore, False))
            return None
        self.ddp.check_skip_allowed()
        if self.native:
            # The flag skips MTP and keeps mtp_process (the tied-embedding stage needs it); the
            # config copy tells everything that counts MTP heads (ModelOpt's loss) there are none.
            if self._other_thread(thread):
                self._refuse_concurrent(module, "skip")
            self._count(key, "skip")
            self.frames.append(_Frame(thread, owner, current, True))
            _set(module, "config", config_without_mtp(base[1]))
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
        if self._other_thread(thread):
            self._refuse_concurrent(module, "skip")
        self._count(key, "skip")
        self.frames.append(_Frame(thread, owner, current, True))
        _set(module, "mtp_process", False)
        _set(module, "config", config_without_mtp(base[1]))
        return None

    # -- frames --------------------------------------------------------------------------------
    def _prune(self, module: torch.nn.Module, finished: FrameType | None) -> None:
        """Drop frames whose call is over (``finished`` counts as over), newest first, restoring
        what each changed. Only interrupted calls leave such frames behind."""
        me = threading.get_ident()
        others = sys._current_frames() if self._other_thread(me) else {}
        here = sys._getframe()
        for i in range(len(self.frames) - 1, -1, -1):
            frame = self.frames[i]
            top = here if frame.thread == me else others.get(frame.thread)
            owner = frame.owner
            if owner is not None and owner is not finished and _on_stack(owner, top):
                continue
            del self.frames[i]
            if frame.restore is not None:
                _set(module, "mtp_process", frame.restore[0])
                _set(module, "config", frame.restore[1])

    def _pop_own(self, caller: FrameType) -> _Frame | None:
        for i in range(len(self.frames) - 1, -1, -1):
            if self.frames[i].owner is caller:
                return self.frames.pop(i)
        return None

    def _other_thread(self, thread: int) -> bool:
        return any(f.thread != thread for f in self.frames)

    def _refuse_concurrent(self, module: torch.nn.Module, decision: str) -> None:
        others = sorted({f.thread for f in self.frames if f.thread != threading.get_ident()})
        raise MTPHooksError(
            f"mtp_hooks: {type(module).__name__} is running a forward in another thread "
            f"({', '.join(map(str, others))}) while this forward needs MTP to {decision} the "
            "other way. The MTP gates are attributes of the shared model, so two threads cannot "
            "hold different decisions at once. Forward one model per thread, serialize the "
            "forwards of this model, or use a megatron-core whose forward accepts the native "
            "compute_mtp_loss flag (per call, no such limit)."
        )

    # -- helpers -------------------------------------------------------------------------------
    def _count(self, key: str, what: str) -> None:
        self.counts[(key, what)] = self.counts.get((key, what), 0) + 1

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

    # -- copies --------------------------------------------------------------------------------
    def __deepcopy__(self, memo: dict[int, Any]) -> MTPGate:
        """A gate of its own for a deep copy of the model, which ``on_copy`` registers.

        Reached through the hooks in the model's hook dicts, so the copied model is in ``memo``
        (still being filled). The copy starts with the gates of the original's base, even when
        the original was copied in the middle of a forward.
        """
        model = self._model()
        if model is None or id(model) not in memo:
            raise UnsupportedModelError(
                "mtp_hooks: copy the attached model itself, not its gate or AttachHandle"
            )
        new = object.__new__(MTPGate)
        new.__dict__.update(self.__dict__)
        new._model = weakref.ref(memo[id(model)])
        new.ddp = _distributed.DDPState(memo[id(model)], [])
        new.base = copy.deepcopy(self.base, memo)
        new.frames = [_Frame(0, None, new.base, False)] if self.frames else []
        new.counts, new.cache, new.last_run = {}, {}, None
        new.lock, new.removed = threading.Lock(), False
        memo[id(self)] = new
        new.handles = copy.deepcopy(self.handles, memo)
        if self.on_copy is not None:
            self.on_copy(new)
        return new


_set = object.__setattr__


def _current(module: torch.nn.Module) -> tuple[Any, Any]:
    return module.mtp_process, module.config


def _on_stack(frame: FrameType, top: FrameType | None) -> bool:
    while top is not None:
        if top is frame:
            return True
        top = top.f_back
    return False


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

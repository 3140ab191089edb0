"""Per-step records of a ``train_rl.py`` run, taken from outside megatron: no edit, no patch.

A GRPO step calls the model in three ways, one after another: the engine's rollout forwards
(under an inference context), the old and reference log-prob passes (``no_grad``), and the
policy-loss forwards (grad, ``train()``). :func:`install` puts one torch forward pre-hook on
the first ``GPTModel``/``HybridModel`` called (found through torch's global module hook, which
is removed at once) and tells the phases apart at each call. At each change of phase it waits
for the GPU and notes the time, so each step gets:

* ``rollout_s``, ``old_logprob_s``, ``ref_logprob_s`` (the log-prob forwards split in two
  halves, one per pass) and ``train_s`` (policy-loss forwards, backward and optimizer, up to the
  next step's first rollout forward);
* the engine's speculation counters for that step's rollouts (the difference of its cumulative
  ``_spec_tokens_proposed_per_pos`` / ``_spec_tokens_accepted_per_pos`` / ``_spec_steps``);
* the rewards and output tokens the agent reported (:func:`note_rollout`), and tokens/s;
  ``cut_rollouts`` and ``cut_tokens``: the rollouts the agent cut after an accepted end token,
  and the tokens it cut (:mod:`agent` says why);
* ``mtp_trained``: what the run's ``trained_mtp()`` said at the step's first policy forward
  (megatron's default: whenever the model has MTP layers);
* ``controller``, where the run's ``on_rollouts`` callback (fed the step's counters before
  its log-prob passes) returns what it found: arm A's controller's state;
* ``peak_gib``, beside ``train_s``: the most GPU memory torch's allocator held from the step's
  first rollout forward to the next step's (the first step's includes start-up).

Records go to a JSON-lines file as they are made: ``train_rl.py`` ends with ``os._exit``, so
nothing may wait for the end. A step's record is written when its policy forwards start; its
``train_s`` follows in a line of its own once the next step begins.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

_state: dict[str, Any] = {"rewards": [], "tokens": 0, "cut_tokens": 0, "cut_rollouts": 0}


def note_rollout(reward: float, tokens: int, cut: int = 0) -> None:
    """Called by the agent for each finished rollout: its reward, its output tokens, and the
    tokens the agent cut after an accepted end token (see :mod:`agent`)."""
    _state["rewards"].append(float(reward))
    _state["tokens"] += int(tokens)
    _state["cut_tokens"] += int(cut)
    _state["cut_rollouts"] += int(cut > 0)


def engine_counters() -> dict[str, Any] | None:
    """The in-process engine's cumulative speculation counters, or None before it exists."""
    try:
        from megatron.rl import rl_utils
    except ImportError:  # a megatron-core wheel: no RL loop, no engine of its
        return None
    interface = getattr(rl_utils, "_INFERENCE_INTERFACE", None)
    engine = getattr(interface, "_inference_engine", None)
    if engine is None or not hasattr(engine, "_spec_tokens_accepted_per_pos"):
        return None

    def ints(value: Any) -> list[int]:
        return [int(v) for v in (value.tolist() if hasattr(value, "tolist") else value)]

    return {
        "proposed": ints(engine._spec_tokens_proposed_per_pos),
        "accepted": ints(engine._spec_tokens_accepted_per_pos),
        "verify_steps": int(engine._spec_steps),
    }


def difference(now: dict[str, Any] | None, before: dict[str, Any] | None) -> dict[str, Any]:
    """``now - before`` per counter, and the chained acceptance and accepted length from it."""
    if now is None:
        return {"proposed": [], "accepted": [], "verify_steps": 0, "accepted_length": None}
    if before is None:
        before = {"proposed": [0] * len(now["proposed"]), "accepted": [0] * len(now["accepted"])}
        before["verify_steps"] = 0
    proposed = [a - b for a, b in zip(now["proposed"], before["proposed"], strict=False)]
    accepted = [a - b for a, b in zip(now["accepted"], before["accepted"], strict=False)]
    chain = [a / p if p else 0.0 for a, p in zip(accepted, proposed, strict=False)]
    return {
        "proposed": proposed,
        "accepted": accepted,
        "verify_steps": now["verify_steps"] - before["verify_steps"],
        "chain_acceptance": chain,
        "accepted_length": sum(chain) if proposed and proposed[0] else None,
    }


class StepRecorder:
    """Tells a GRPO step's phases apart from the model's calls and writes one record a step."""

    def __init__(
        self,
        path: str,
        trained_mtp: Callable[[Any], bool] = lambda model: bool(model.config.mtp_num_layers),
        on_rollouts: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None,
    ) -> None:
        self.path, self.trained_mtp, self.on_rollouts = path, trained_mtp, on_rollouts
        self.step, self.last, self.marks = 0, "start", {}
        self.logprob_times: list[float] = []
        self.counters: dict[str, Any] | None = None
        self.hook: Any = None
        self.inference_mode: Callable[[], bool] | None = None

    def kind(self, module: Any, kwargs: dict[str, Any]) -> str:
        import torch

        if kwargs.get("inference_context") is not None:
            return "rollout"
        if self.inference_mode is None:
            try:
                from megatron.core.inference.utils import InferenceMode

                self.inference_mode = InferenceMode.is_active
            except (ImportError, AttributeError):  # older cores: the context alone tells
                self.inference_mode = lambda: False
        if self.inference_mode():
            return "rollout"
        return "train" if module.training and torch.is_grad_enabled() else "logprob"

    def now(self) -> float:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def __call__(self, module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        kind = self.kind(module, kwargs)
        if kind == "logprob":
            self.logprob_times.append(time.perf_counter())
        if kind == self.last:
            return
        t = self.now()
        if kind == "rollout" and self.last == "train":
            self.write({"step": self.step, "train_s": t - self.marks["train"], **peak_memory()})
        if kind == "rollout":
            self.step += 1
            self.marks = {"rollout": t}
            self.logprob_times = []
        elif kind == "logprob" and self.last in ("rollout", "start", "train"):
            self.logprob_times = [t]
            self.marks["logprob"] = t
            counters = engine_counters()
            self.marks["spec"] = difference(counters, self.counters)
            self.counters = counters
            if self.on_rollouts is not None:
                self.marks["controller"] = self.on_rollouts(self.marks["spec"])
        elif kind == "train":
            self.marks["train"] = t
            self.write(self.record(module, t))
        self.last = kind

    def record(self, module: Any, t: float) -> dict[str, Any]:
        marks, times = self.marks, self.logprob_times
        rollout_s = marks["logprob"] - marks["rollout"] if "rollout" in marks else None
        half = times[len(times) // 2] if len(times) > 1 else t
        rewards, tokens = _state["rewards"], _state["tokens"]
        cut_tokens, cut_rollouts = _state["cut_tokens"], _state["cut_rollouts"]
        _state.update(rewards=[], tokens=0, cut_tokens=0, cut_rollouts=0)
        return {
            "step": self.step,
            "rollout_s": rollout_s,
            "old_logprob_s": half - marks["logprob"] if "logprob" in marks else None,
            "ref_logprob_s": t - half if "logprob" in marks else None,
            "logprob_forwards": len(times),
            "rollouts": len(rewards),
            "reward": sum(rewards) / len(rewards) if rewards else None,
            "output_tokens": tokens,
            "tokens_per_s": tokens / rollout_s if rollout_s else None,
            "cut_rollouts": cut_rollouts,
            "cut_tokens": cut_tokens,
            "spec": marks.get("spec"),
            "mtp_trained": bool(self.trained_mtp(module)),
            **({"controller": marks["controller"]} if marks.get("controller") else {}),
        }


def peak_memory() -> dict[str, float]:
    """The allocator's peak since the last call, in GiB (empty without a GPU); resets it."""
    import torch

    if not torch.cuda.is_available():
        return {}
    peak = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    return {"peak_gib": peak}


def install(recorder: StepRecorder) -> None:
    """Hooks ``recorder`` onto the first Megatron language model that runs a forward."""
    import torch

    def first_call(module: Any, args: tuple) -> None:
        names = {cls.__name__ for cls in type(module).__mro__}
        if recorder.hook is None and names & {"GPTModel", "HybridModel"}:
            recorder.hook = module.register_forward_pre_hook(recorder, with_kwargs=True)
            handle.remove()  # this first call goes unrecorded: a global hook sees no kwargs

    handle = torch.nn.modules.module.register_module_forward_pre_hook(first_call)

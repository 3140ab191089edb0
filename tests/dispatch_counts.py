"""What a step dispatches, counted with torch's profiler: one helper for the CPU tests (ATen
operations with their input shapes) and the GPU tests (the CUDA kernels launched).

Both count after one warm-up call (the first call of a kind allocates what later calls reuse),
so two counts compare like for like: a skip against the model built without MTP, hooks that
say *run* against no hooks.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch

import mtp_hooks


def dispatched(step: Callable[[], Any], device: str = "cpu") -> collections.Counter[Any]:
    """On ``"cpu"``, the ATen operations ``step()`` dispatches, as ``(name, input shapes)``; on
    ``"cuda"``, the CUDA kernels it launches, by name. Counted, after one warm-up call."""
    cuda = device == "cuda"
    step()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        torch.cuda.synchronize()
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, record_shapes=not cuda) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    if cuda:
        kernel = torch.autograd.DeviceType.CUDA
        return collections.Counter(e.name for e in prof.events() if e.device_type == kernel)
    return collections.Counter(
        (e.name, str(e.input_shapes)) for e in prof.events() if e.name.startswith("aten::")
    )


def phase_steps(model: Any, args: tuple[Any, ...], labels: Any) -> dict[str, Callable[[], None]]:
    """A train step, a log-prob forward (``rollout``) and an eval forward of ``model``."""

    def train() -> None:
        model.train()
        model.zero_grad(set_to_none=True)
        model(*args, labels=labels).float().mean().backward()

    def rollout() -> None:
        model.eval()
        with torch.no_grad(), mtp_hooks.phase("rollout"):
            model(*args)

    def evaluate() -> None:
        model.eval()
        with torch.no_grad():
            model(*args, labels=labels)

    return {"train": train, "rollout": rollout, "eval": evaluate}

"""Test-harness stand-ins that let megatron's Mamba-2 layer run on a machine without a GPU.

megatron-core's ``MambaMixer`` computes its state-space scan with mamba-ssm's Triton kernels.
Triton's interpreter (``TRITON_INTERPRET=1``) runs those same kernels on the CPU, one program
instance at a time, so the tests exercise megatron's real Mamba-2 layer and mamba-ssm's real
kernels, only slower. What stands in, and why:

* ``import mamba_ssm``: the package's ``__init__`` imports its CUDA selective-scan extension,
  which a build without CUDA lacks and megatron's Mamba-2 never calls. A bare package object
  for the installed folder lets megatron import the Triton modules it needs
  (:func:`expose_mamba_triton_kernels`, before megatron is imported).
* The kernels' launch plumbing: ``torch.cuda.device`` (a device context around each launch), and
  ``torch.cuda.get_device_properties`` (the number of multiprocessors, to size a grid) for CPU
  tensors; the autotuners keep their first configuration (the interpreter has nothing to tune,
  and would benchmark through a GPU driver); megatron's MoE routers allocate their expert bias
  on ``torch.cuda.current_device()``.
* ``torch.compile``: megatron compiles its router functions, and inductor asks the device
  properties the stand-in answers for CPU tensors; the routers run eagerly instead.

None of this is in the library: the fixture ``mamba_cpu`` of tests/model_fixtures.py installs it
for one test and takes it away after.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types
from typing import Any


def expose_mamba_triton_kernels() -> None:
    """On a machine without CUDA: Triton's interpreter for every kernel defined from here on,
    and mamba-ssm importable without its CUDA extension. Call before megatron is imported."""
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        return
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if "mamba_ssm" in sys.modules:
        return
    try:
        spec = importlib.util.find_spec("mamba_ssm")
    except (ImportError, ValueError):
        return
    if spec is None or not spec.submodule_search_locations:
        return
    try:
        import mamba_ssm  # noqa: F401
    except ImportError:
        package = types.ModuleType("mamba_ssm")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["mamba_ssm"] = package


def mamba_runs_here() -> bool:
    """Whether megatron can build and run a Mamba-2 layer in this process."""
    from mtp_hooks.demo import nemotron_models

    if not nemotron_models.can_build_mamba():
        return False
    import torch

    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def kernel_launches_on_cpu(monkeypatch: Any) -> Any:
    """The stand-ins above, through ``monkeypatch`` (pytest's), for one test; returns the
    context to run the test in (torch.compile off)."""
    import torch
    import triton.runtime.autotuner as autotuner

    real_properties = torch.cuda.get_device_properties

    def properties(device: Any = None) -> Any:
        if isinstance(device, torch.device) and device.type == "cpu":
            return types.SimpleNamespace(multi_processor_count=os.cpu_count() or 1)
        return real_properties(device)

    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "device", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(("mamba_ssm.", "megatron.core.ssm.ops")):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, autotuner.Autotuner) and len(value.configs) > 1:
                monkeypatch.setattr(value, "configs", value.configs[:1])
    return torch._dynamo.config.patch(disable=True)

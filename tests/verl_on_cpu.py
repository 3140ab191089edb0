"""What a CPU lacks for veRL 0.9.1's actor worker (tests/verl_worker.py), each stood in here.

veRL and megatron assume an accelerator in a few places: veRL's platform registry has no CPU
platform, its process group names gloo twice on a CPU, and megatron's optimizer, DDP and RNG
make CUDA tensors and streams directly. Test code only; the library never does any of this.
"""

from __future__ import annotations

from typing import Any


def register_cpu_platform() -> None:
    """A ``cpu`` platform in veRL's own registry (veRL has none, and falls back to CUDA)."""
    import contextlib
    from types import ModuleType

    import torch
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    # torch.cpu, with the memory queries veRL's memory logging makes answered with zeros
    device_module = ModuleType("cpu_device_module")
    zeros = {"mem_get_info": lambda *a, **k: (0, 0), "get_device_name": lambda *a, **k: "CPU"}
    device_module.__getattr__ = lambda name: (  # type: ignore[method-assign]
        getattr(torch.cpu, name) if hasattr(torch.cpu, name) else zeros.get(name, lambda *a, **k: 0)
    )

    @PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"

        @property
        def device_module(self) -> ModuleType:
            return device_module

        def is_available(self) -> bool:
            return True

        def current_device(self) -> int:
            return 0

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            pass

        def synchronize(self, device_index: int | None = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        def nvtx_range(self, msg: str) -> contextlib.AbstractContextManager[None]:
            return contextlib.nullcontext()

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> None:
            return None


def point_megatron_at_the_cpu() -> None:
    """megatron's own CUDA calls on the worker's path, each pointed at the CPU."""
    import torch
    from megatron.core import parallel_state, tensor_parallel

    from cpu_stand_ins import install_cpu_memory_buffer, point_cuda_current_device_at_cpu

    def seed_on_cpu(seed: int, *args: Any, **kwargs: Any) -> None:  # CUDA generators
        torch.manual_seed(seed)
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)

    tensor_parallel.model_parallel_cuda_manual_seed = seed_on_cpu
    parallel_state._set_global_memory_buffer = install_cpu_memory_buffer  # local attention's
    point_cuda_current_device_at_cpu()  # DDP's grad buffers, TP gathers

    class CpuStream:  # DDP's grad sync waits on the current stream for CUDA-graph events
        def wait_event(self, event: Any) -> None:
            pass

        def wait_stream(self, stream: Any) -> None:
            pass

    torch.cuda.current_stream = lambda *args, **kwargs: CpuStream()


def cuda_on_the_cpu() -> Any:
    """A torch function mode under which megatron's hard-coded CUDA tensors are made on the
    CPU (``device="cuda"`` in its optimizer and gradient clipping), and a 16-bit parameter
    reports the CUDA tensor type that megatron's optimizers test for by name."""
    import torch
    from torch.overrides import TorchFunctionMode

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            device = kwargs.get("device")
            if device is not None and on_cuda(device):
                kwargs = {**kwargs, "device": "cpu"}
            if func is torch.Tensor.type and len(args) == 1 and not kwargs:
                return func(*args).replace("torch.", "torch.cuda.", 1)
            if func is torch.Tensor.to and len(args) > 1 and on_cuda(args[1]):  # .to(device id)
                args = (args[0], "cpu", *args[2:])
            return func(*args, **kwargs)

    def on_cuda(device: Any) -> bool:
        return isinstance(device, int) or (
            isinstance(device, str | torch.device) and torch.device(device).type == "cuda"
        )

    return Mode()


def start_gloo() -> None:
    """veRL asks for ``cpu:gloo,<device>:<backend>``, which on a CPU names gloo twice; the
    group it would start, started first."""
    import torch

    torch.distributed.init_process_group("gloo", rank=0, world_size=1)

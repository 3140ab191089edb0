"""Test-harness stand-ins for the CUDA-only allocations megatron makes even on a CPU.

Used by the model fixtures (tests/model_fixtures.py) and the multi-rank harness
(tests/distributed/_harness.py), never by the library.
"""

from __future__ import annotations

import math


def install_cpu_memory_buffer() -> None:
    """Replace megatron's global scratch buffer (local attention) with one that allocates on CPU."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.utils import GlobalMemoryBuffer

    class CPUMemoryBuffer(GlobalMemoryBuffer):
        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
            required = math.prod(tensor_shape)
            buf = self.buffer.get((name, dtype))
            if buf is None or buf.numel() < required:
                buf = self.buffer[(name, dtype)] = torch.empty(required, dtype=dtype)
            return buf[:required].view(*tensor_shape)

    parallel_state._GLOBAL_MEMORY_BUFFER = CPUMemoryBuffer()


def point_cuda_current_device_at_cpu() -> None:
    """TP gathers allocate on ``torch.cuda.current_device()``; in a CPU test process, the CPU."""
    import torch

    torch.cuda.current_device = lambda: torch.device("cpu")


def keep_cuda_copies_on_cpu() -> None:
    """With PP > 1 and MTP, megatron moves the embedding weight it all-reduces between the
    embedding stages to CUDA while building the model (``weight.data.cuda()``,
    language_module.py); in a CPU test process the copy stays on the CPU."""
    import torch

    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]


def cpu_causal_mask(sq: int):
    """megatron's ``get_default_causal_mask`` (fused_softmax.py), which its local softmax calls
    when a call passes no mask, built on the CPU instead of CUDA: patch it in for a test."""
    import torch

    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

"""Test harness for multi-rank CPU runs: spawn gloo ranks with a hard timeout, collect results.

Each rank runs a scenario function in a fresh process (``spawn``) and writes a JSON result
file; a rank that has not finished by the deadline is killed and the test fails, so a
disagreement between ranks shows up as a failure and never as a hang.

The CUDA stand-ins (tests/cpu_stand_ins.py) are installed in these test processes only:
megatron's TP gather allocates on ``torch.cuda.current_device()`` and its local attention takes
a CUDA scratch buffer.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import traceback
from collections.abc import Callable
from pathlib import Path

from cpu_stand_ins import (
    install_cpu_memory_buffer,
    keep_cuda_copies_on_cpu,
    point_cuda_current_device_at_cpu,
)
from ports import free_port


def init_rank(rank: int, world: int, port: int, tp: int, pp: int = 1, cp: int = 1) -> None:
    import torch
    from megatron.core import parallel_state, tensor_parallel

    # One thread per rank: the ranks of a test share the machine's cores, and under that load
    # an OpenMP runtime may give a parallel region fewer threads than asked, which splits a
    # reduction differently and changes its last bits. The tests compare runs bit for bit.
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ["MTP_HOOKS_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp
    )
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    install_cpu_memory_buffer()
    point_cuda_current_device_at_cpu()
    if pp > 1:
        keep_cuda_copies_on_cpu()


def _entry(
    scenario: Callable[[int], dict],
    rank: int,
    world: int,
    port: int,
    tp: int,
    pp: int,
    cp: int,
    out: str,
):
    result: dict
    try:
        init_rank(rank, world, port, tp, pp, cp)
        result = {"ok": True, **scenario(rank)}
    except BaseException as exc:  # reported to the parent test, never swallowed
        result = {
            "ok": False,
            "error": type(exc).__name__,
            "message": str(exc),
            "traceback": traceback.format_exc(),
        }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    try:
        import torch

        torch.distributed.destroy_process_group()
    except Exception:
        pass


def run_ranks(
    scenario: Callable[[int], dict],
    world: int,
    tp: int,
    tmp: Path,
    timeout: float = 120,
    pp: int = 1,
    cp: int = 1,
) -> list[dict]:
    """Run ``scenario(rank)`` on ``world`` gloo ranks (``tp`` × ``pp`` × ``cp``); return each
    rank's result dict."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(scenario, r, world, port, tp, pp, cp, str(tmp)))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    hung = [i for i, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(10)
    if hung:
        raise AssertionError(f"ranks {hung} did not finish within {timeout}s (a hang)")
    return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]

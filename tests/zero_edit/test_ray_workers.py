"""The policy reaches Ray workers through ``runtime_env`` alone, as veRL and NeMo-RL start them.

A local one-CPU Ray instance on 127.0.0.1; each task builds a tiny GPTModel in its worker process
and runs a training forward and an evaluation forward (``eval()`` + ``no_grad``, as the
frameworks' log-prob forwards run). No task code mentions mtp-hooks.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("megatron.core")

TESTS = str(Path(__file__).resolve().parent.parent)
SWITCH = {"env_vars": {"MTP_HOOKS_AUTO": "1", "MTP_HOOKS_POLICY": "train=run,eval=skip"}}


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=1, include_dashboard=False, _node_ip_address="127.0.0.1")
    yield
    ray.shutdown()


@ray.remote
def mtp_forwards_in_a_worker(tests: str) -> dict[str, int]:
    import sys

    import torch

    sys.path.insert(0, tests)
    from mtp_hooks.demo import tiny_models  # to build the model only

    from cpu_stand_ins import install_cpu_memory_buffer

    tiny_models.init_single_process(port=tiny_models.free_port())
    install_cpu_memory_buffer()
    tiny_models.reset_mtp_loss_tracker()
    model = tiny_models.build_gpt(tiny_models.TinySpec(seq_length=16, vocab_size=128))
    runs, phase = {"train": 0, "eval": 0}, ["train"]
    model.mtp.register_forward_hook(lambda *a: runs.__setitem__(phase[0], runs[phase[0]] + 1))
    ids = torch.randint(0, 128, (2, 16))
    pos = torch.arange(16)[None].expand(2, -1)
    mask = torch.triu(torch.ones(16, 16, dtype=torch.bool), 1)[None, None].expand(2, 1, 16, 16)
    labels = torch.roll(ids, -1, 1)
    model(ids, pos, mask, labels=labels).sum().backward()
    phase[0] = "eval"
    model.eval()
    with torch.no_grad():
        model(ids, pos, mask, labels=labels)
    return runs


def test_runtime_env_variables_gate_the_workers_models(local_ray):
    task = mtp_forwards_in_a_worker.options(runtime_env=SWITCH)
    assert ray.get(task.remote(TESTS), timeout=240) == {"train": 1, "eval": 0}


def test_without_them_megatron_runs_mtp_in_the_workers_eval_forward(local_ray):
    off = {"env_vars": {"MTP_HOOKS_AUTO": "0"}}
    task = mtp_forwards_in_a_worker.options(runtime_env=off)
    assert ray.get(task.remote(TESTS), timeout=240) == {"train": 1, "eval": 1}

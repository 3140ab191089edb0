"""What the GPU tests share, so that no module repeats it: they are collected only where torch
and megatron-core are installed, each is marked ``gpu`` and skipped without a CUDA GPU,
Transformer Engine picks only deterministic algorithms (bit identity needs them), and
megatron's parallel state (one rank, set up for each module) and MTP loss tracker (zeroed on
CUDA before each test that asks for it) are fixtures.

A module's own ``pytestmark`` says only what it needs beyond that: Transformer Engine,
FlashAttention, a megatron-core field, and which loss tracker it uses.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


# The core session has neither: its modules import torch at the top, so they are not collected.
collect_ignore_glob = [] if _installed("torch") and _installed("megatron.core") else ["*.py"]

# Read when Transformer Engine is imported, which a test module may do at its top.
os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.gpu)


def pytest_runtest_setup(item: pytest.Item) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.fixture(scope="module")
def megatron_gpu():
    from mtp_hooks.demo import tiny_models

    tiny_models.init_single_process(port=tiny_models.free_port())


@pytest.fixture
def cuda_mtp_tracker(megatron_gpu):
    from mtp_hooks.demo import tiny_models

    tiny_models.reset_mtp_loss_tracker(device="cuda")


@pytest.fixture
def nemotron_tracker(cuda_mtp_tracker):
    """The loss tracker sized for the shared Nemotron-3-shaped model's MTP depths."""
    from mtp_hooks.demo import tiny_models

    from nemotron_on_gpu import DEPTHS

    tiny_models.reset_mtp_loss_tracker(num_layers=DEPTHS, device="cuda")

"""What the GPU tests share: megatron's parallel state (one rank, set up for each module),
and megatron's MTP loss tracker zeroed on CUDA before each test that asks for it."""

from __future__ import annotations

import pytest


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

"""Adapter tests run on real megatron-core models on a CPU (fixtures: tests/model_fixtures.py)."""

import pytest


@pytest.fixture(autouse=True)
def zeroed_mtp_tracker(mtp_tracker):
    """Every test starts with megatron's MTP loss tracker zeroed, on the CPU."""

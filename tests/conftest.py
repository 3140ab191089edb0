"""Test plugins shared by the suites (the fresh state every test starts from is set up by the
repository's root conftest.py, which the doctests share).

Where megatron-core is installed, tests/model_fixtures.py is a plugin of every suite: the tiny
real models and the stand-ins they need on a CPU.
"""

from __future__ import annotations

import importlib.util

import pytest

from mamba_on_cpu import expose_mamba_triton_kernels
from plugin_answers import Answers, answers

expose_mamba_triton_kernels()  # before megatron is imported: it decides HAVE_MAMBA_SSM then


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (its parent packages are, without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


pytest_plugins = ["model_fixtures"] if installed("megatron.core") and installed("torch") else []


@pytest.fixture
def voter():
    """Factory: ``voter(False, name="x")`` registers a plugin whose ``should_run_mtp`` votes
    ``False`` (``plugin_answers.answers``) and returns it; ``.calls`` records its calls."""

    def make(vote: bool | None, name: str) -> Answers:
        return answers("should_run_mtp", vote, name=name)

    return make

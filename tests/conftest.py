"""Test plugins shared by the suites (the fresh state every test starts from is set up by the
repository's root conftest.py, which the doctests share).

Where megatron-core is installed, tests/model_fixtures.py is a plugin of every suite: the tiny
real models and the stand-ins they need on a CPU.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import mtp_hooks

from installed_distributions import install  # noqa: F401  (a fixture of every suite)
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

# The modules whose tests take a minute or more run first. Under pytest-xdist's worksteal each
# worker starts on a contiguous share of the collection and steals only from others' queues, so
# a long test collected last would leave the other worker idle while it ends the run.
LONG_FIRST = (
    "tests/stress/test_stress.py",
    "tests/adapters/test_sampled_figure_against_a_sampling_engine.py",
    "tests/adapters/test_benchmarks.py",
    "tests/adapters/test_compile.py",
    "tests/plugins/test_verl_worker.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    root = Path(__file__).resolve().parent.parent
    missing = [path for path in LONG_FIRST if not (root / path).exists()]
    if missing:  # a renamed module would quietly lose its place
        raise pytest.UsageError(f"tests/conftest.py: LONG_FIRST names no file at {missing}")

    def rank(item: pytest.Item) -> int:
        path = item.path.as_posix()
        ranks = (i for i, tail in enumerate(LONG_FIRST) if path.endswith(tail))
        return next(ranks, len(LONG_FIRST))

    items.sort(key=rank)  # stable: every module's tests stay together and in order


@pytest.fixture
def voter():
    """Factory: ``voter(False, name="x")`` registers a plugin whose ``should_run_mtp`` votes
    ``False`` (``plugin_answers.answers``) and returns it; ``.calls`` records its calls."""

    def make(vote: bool | None, name: str) -> Answers:
        return answers("should_run_mtp", vote, name=name)

    return make


@pytest.fixture
def monitored():
    """``(hook name, plugin names, answers)`` of every hook call pluggy makes, in order."""
    calls: list[tuple[str, tuple[str, ...], object]] = []

    def before(hook_name, hook_impls, kwargs):
        pass

    def after(outcome, hook_name, hook_impls, kwargs):
        names = tuple(impl.plugin_name for impl in hook_impls)
        calls.append((hook_name, names, outcome.exception or outcome.get_result()))

    undo = mtp_hooks.plugins.get_plugin_manager().add_hookcall_monitoring(before, after)
    yield calls
    undo()

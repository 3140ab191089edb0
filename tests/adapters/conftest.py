"""Adapter tests run on real megatron-core models on a CPU (fixtures in tests/model_fixtures.py)."""

from model_fixtures import *  # noqa: F401,F403

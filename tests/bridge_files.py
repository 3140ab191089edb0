"""Megatron-Bridge's own files, loaded one by one: ``megatron.bridge`` cannot be imported on a
CPU machine (its package imports Transformer Engine), but modules whose imports are
megatron-core, torch and what Bridge's wheel needs besides can be run from their files."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType


def bridge_root() -> Path | None:
    """The installed ``megatron/bridge`` folder, or ``None``."""
    spec = importlib.util.find_spec("megatron.bridge")
    return None if spec is None else Path(next(iter(spec.submodule_search_locations)))


def load_file(path: Path, name: str) -> ModuleType:
    """The module at ``path``, run from its file under ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

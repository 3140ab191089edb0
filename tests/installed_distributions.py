"""Distributions made for a test: real ``.dist-info`` metadata on ``sys.path``, so that entry
points are found through ``importlib.metadata`` exactly as for an installed package."""

from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# The framework plugins of plugins/ may be installed here too, and vote once configured.
FRAMEWORK_PLUGINS = "verl,nemo,modelopt"


@pytest.fixture
def install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., str]]:
    """``install(dist, module_source, ep_name=..., group=...)`` makes an importable
    distribution whose module is an entry point of ``group`` (default ``mtp_hooks``, the
    plugins; ``mtp_hooks.options`` for contributed options), with entry-point autoload on and
    the framework plugins of plugins/ disabled; it returns the module's name."""
    monkeypatch.delenv("MTP_HOOKS_DISABLE_PLUGIN_AUTOLOAD")
    monkeypatch.setenv("MTP_HOOKS_DISABLE", FRAMEWORK_PLUGINS)
    monkeypatch.syspath_prepend(str(tmp_path))
    created: list[str] = []

    def make(
        dist: str,
        source: str,
        ep_name: str | None = None,
        version: str = "1.0",
        group: str = "mtp_hooks",
        attribute: str = "",
    ) -> str:
        module = dist.replace("-", "_")
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        info = tmp_path / f"{module}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        target = f"{module}:{attribute}" if attribute else module
        (info / "entry_points.txt").write_text(f"[{group}]\n{ep_name or dist} = {target}\n")
        created.append(module)
        importlib.invalidate_caches()
        return module

    yield make
    for module in created:
        sys.modules.pop(module, None)

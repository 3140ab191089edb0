"""``MTP_HOOKS_AUTO=1``: turn on auto-attach in every Python process that sees the variable.

The wheel installs ``mtp_hooks_auto.pth`` into site-packages. Python runs its one line at
interpreter start; it costs one environment lookup while the variable is unset, and only then
imports this module, which imports neither torch nor megatron-core. :func:`start` waits for the
program's own ``import torch`` (a ``sys.meta_path`` finder, the import system's public hook) and
turns :func:`mtp_hooks.auto_attach` on right after it. A failure prints one warning and never
stops the interpreter.

The one piece of state outside the runtime is the ``.pth`` line's own flag,
``sys._mtp_hooks_warned``: that line must warn once when ``mtp_hooks`` itself fails to import,
and ``site`` runs it twice in a virtual environment whose ``lib64`` links to ``lib``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from . import _env, _runtime

ENV_AUTO = "MTP_HOOKS_AUTO"


def start() -> None:
    """Turn auto-attach on now if torch is loaded, else as soon as it is; a no-op when off."""
    if not _env.flag(ENV_AUTO) or any(isinstance(f, _AfterTorch) for f in sys.meta_path):
        return
    if "torch" in sys.modules:
        _enable()
    else:
        sys.meta_path.insert(0, _AfterTorch())


def _enable() -> None:
    try:
        from .megatron._auto import enable

        enable()
    except Exception as exc:  # never break the program that imported torch
        warn(f"{type(exc).__name__}: {exc}")


def warn(reason: str) -> None:
    """Print the one start-up warning of this process (the runtime remembers it was given)."""
    message = f"{ENV_AUTO} could not start"
    if message not in _runtime.process.warned:
        _runtime.process.warned.add(message)
        print(
            f"mtp-hooks: warning: {ENV_AUTO} is set but auto-attach could not start ({reason}); "
            "models run without MTP policies",
            file=sys.stderr,
        )


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps torch's loader so that auto-attach starts once torch ran."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)  # one-shot; the real finders locate torch
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenEnable(spec.loader)
        return spec


class _ThenEnable(importlib.abc.Loader):
    """torch's own loader, followed by :func:`_enable`."""

    def __init__(self, loader: Any):
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self.loader.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        _enable()

    def __getattr__(self, name: str) -> Any:  # resource readers and the like
        return getattr(self.loader, name)

"""mtp-hooks: decide, at every forward call, whether a Megatron-Core model runs its MTP block.

Policies come from a per-phase config and from pluggy plugins implementing ``should_run_mtp``;
:func:`attach` makes ``GPTModel`` and ``HybridModel`` consult them through public ``nn.Module``
hooks. Importing this package has no side effects and does not import megatron-core.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from . import _runtime
from ._decision import Decision, decide, explain
from ._errors import (
    DecisionMismatchError,
    MTPHooksError,
    PluginError,
    PluginLoadError,
    PolicyConflictError,
    PolicyError,
    UnknownPluginError,
    UnsupportedModelError,
)
from ._loss_masks import mtp_loss_mask
from ._metrics import MTPMetrics
from ._phases import Phase, PhaseLike, current_phase, declare_phase, phase
from ._roles import role_of, set_role
from ._sources import configure, reload
from .hookspecs import hookimpl, hookspec  # noqa: F401  (kept importable, not advertised)
from .plugins import get_plugin_manager, list_plugins, register, unregister  # noqa: F401

if TYPE_CHECKING:
    from .megatron import (
        AttachHandle,
        attach,
        auto_attach,
        clip_mtp_apart,
        detach,
        freeze_mtp,
        freeze_trunk,
    )

# What the package advertises (``from mtp_hooks import *``, the docs). ``reset`` (for tests),
# ``hookspec`` and ``get_plugin_manager`` (for plugin authors: mtp_hooks.hookspecs and
# mtp_hooks.plugins) stay importable from here without being advertised.
__all__ = [
    "AttachHandle",
    "Decision",
    "DecisionMismatchError",
    "MTPHooksError",
    "MTPMetrics",
    "Phase",
    "PhaseLike",
    "PluginError",
    "PluginLoadError",
    "PolicyConflictError",
    "PolicyError",
    "UnknownPluginError",
    "UnsupportedModelError",
    "attach",
    "auto_attach",
    "clip_mtp_apart",
    "configure",
    "current_phase",
    "decide",
    "declare_phase",
    "detach",
    "explain",
    "freeze_mtp",
    "freeze_trunk",
    "hookimpl",
    "list_plugins",
    "mtp_loss_mask",
    "phase",
    "register",
    "reload",
    "role_of",
    "set_role",
    "unregister",
]

_MEGATRON_NAMES = {
    "AttachHandle",
    "attach",
    "auto_attach",
    "clip_mtp_apart",
    "detach",
    "freeze_mtp",
    "freeze_trunk",
}


def __getattr__(name: str) -> Any:
    # The Megatron adapters import torch and megatron-core, so they load on first use only;
    # the version is read from the installed distribution when asked for.
    if name in _MEGATRON_NAMES:
        from . import megatron

        return getattr(megatron, name)
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("mtp-hooks")
        except PackageNotFoundError:
            return "0+unknown"
    raise AttributeError(f"module 'mtp_hooks' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names, with the lazily loaded ones (``attach`` and the rest)."""
    return sorted(set(globals()) | _MEGATRON_NAMES | {"__version__"})


def reset() -> None:
    """Return mtp-hooks to a fresh state: plugin manager, config, declared phases and roles.

    Meant for tests. The next use builds a new plugin manager and reloads entry points, and
    auto-attach stops watching for new models. Hooks already attached to models stay attached;
    remove them with ``handle.remove()``.
    """
    auto = sys.modules.get("mtp_hooks.megatron._auto")
    if auto is not None:
        auto.enable(False)
    _runtime.replace()

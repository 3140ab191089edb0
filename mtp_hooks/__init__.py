"""mtp-hooks: decide, at every forward call, whether a Megatron-Core model runs its MTP block.

Policies come from a per-phase config and from pluggy plugins implementing ``should_run_mtp``;
:func:`attach` makes ``GPTModel`` and ``HybridModel`` consult them through public ``nn.Module``
hooks. Importing this package has no side effects and imports neither torch nor megatron-core.

Each public name has one home:

* users import from ``mtp_hooks`` (this module);
* plugin authors from :mod:`mtp_hooks.plugins` (``hookimpl``, ``hookspec``, ``register``);
* framework plugins' helpers come from :mod:`mtp_hooks.framework`;
* test suites reset the state between tests with :func:`mtp_hooks.testing.reset`.
"""

from __future__ import annotations

from typing import Any

from . import framework, plugins, testing  # noqa: F401  (each public name's home)
from ._decision import Decision, decide
from ._errors import (
    DecisionMismatchError,
    MTPHooksError,
    PluginError,
    PolicyConflictError,
    PolicyError,
    UnknownPluginError,
    UnsupportedModelError,
)
from ._explain import explain
from ._loss_masks import mtp_loss_mask
from ._metrics import MTPMetrics
from ._phase_catalogue import declare_phase, phase
from ._phases import Phase, PhaseLike, current_phase
from ._roles import role_of, set_role
from ._sources import configure, reload
from .megatron import (
    AttachHandle,
    attach,
    auto_attach,
    clip_mtp_apart,
    detach,
    freeze_mtp,
    freeze_trunk,
)

__all__ = [
    "AttachHandle",
    "Decision",
    "DecisionMismatchError",
    "MTPHooksError",
    "MTPMetrics",
    "Phase",
    "PhaseLike",
    "PluginError",
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
    "mtp_loss_mask",
    "phase",
    "reload",
    "role_of",
    "set_role",
]

# Names that moved to their one home; importable from here, with a DeprecationWarning, until
# the release after next (CHANGELOG.md).
_MOVED = {
    "hookimpl": "mtp_hooks.plugins",
    "hookspec": "mtp_hooks.plugins",
    "register": "mtp_hooks.plugins",
    "unregister": "mtp_hooks.plugins",
    "list_plugins": "mtp_hooks.plugins",
    "get_plugin_manager": "mtp_hooks.plugins",
    "reset": "mtp_hooks.testing",
}


def __getattr__(name: str) -> Any:
    # The version is read from the installed distribution when asked for.
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("mtp-hooks")
        except PackageNotFoundError:
            return "0+unknown"
    home = _MOVED.get(name)
    if home is None and name == "PluginLoadError":
        home, new = "mtp_hooks", "PluginError"
    else:
        new = name
    if home is not None:
        import importlib
        import sys
        import warnings

        # ``from mtp_hooks import name`` first asks ``hasattr`` (importlib's _handle_fromlist,
        # looking for a submodule of that name), then gets the attribute: warn only then, so
        # every way of reaching a moved name warns once.
        if sys._getframe(1).f_code.co_name == "_handle_fromlist":
            return getattr(importlib.import_module(home), new)
        warnings.warn(
            f"mtp_hooks.{name} is deprecated; use {home}.{new}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(home), new)
    raise AttributeError(f"module 'mtp_hooks' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names, with ``__version__`` (read when asked for)."""
    return sorted(set(globals()) | {"__version__"})

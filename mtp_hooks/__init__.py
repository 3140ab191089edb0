"""mtp-hooks: decide, at every forward call, whether a Megatron-Core model runs its MTP block.

Policies come from a per-phase config and from pluggy plugins implementing ``should_run_mtp``;
:func:`attach` makes ``GPTModel`` and ``HybridModel`` consult them through public ``nn.Module``
hooks. Importing this package has no side effects and imports neither torch nor megatron-core.

Each public name has one home:

* users import from ``mtp_hooks`` (this module);
* plugin authors from :mod:`mtp_hooks.plugins` (``hookimpl``, ``hookspec``, ``register``);
* the parameter editors (``freeze_mtp``, ``freeze_trunk``, ``clip_mtp_apart``), which change
  a model's weights rather than what a forward runs, from :mod:`mtp_hooks.megatron`;
* framework plugins' helpers come from :mod:`mtp_hooks.framework`;
* test suites reset the state between tests with :func:`mtp_hooks.testing.reset`.
"""

from __future__ import annotations

from typing import Any

from . import framework, megatron, plugins, testing  # noqa: F401  (each public name's home)
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
from ._forward_call import ForwardCall
from ._loss_masks import mtp_loss_mask
from ._metrics import MTPMetrics
from ._option_base import Options
from ._phase_catalogue import declare_phase, phase
from ._phases import Phase, PhaseLike, current_phase
from ._roles import role_of, set_role
from ._sources import configure, reload
from .megatron import AttachHandle, attach, auto_attach, remove

__all__ = [
    "AttachHandle",
    "Decision",
    "DecisionMismatchError",
    "ForwardCall",
    "MTPHooksError",
    "MTPMetrics",
    "Options",
    "Phase",
    "PhaseLike",
    "PluginError",
    "PolicyConflictError",
    "PolicyError",
    "UnknownPluginError",
    "UnsupportedModelError",
    "attach",
    "auto_attach",
    "configure",
    "current_phase",
    "decide",
    "declare_phase",
    "explain",
    "mtp_loss_mask",
    "phase",
    "reload",
    "remove",
    "role_of",
    "set_role",
]

# Where the names that live in a submodule are, for the error of someone who looks for them here.
_ELSEWHERE = {
    "hookimpl": "mtp_hooks.plugins",
    "hookspec": "mtp_hooks.plugins",
    "register": "mtp_hooks.plugins",
    "unregister": "mtp_hooks.plugins",
    "list_plugins": "mtp_hooks.plugins",
    "get_plugin_manager": "mtp_hooks.plugins",
    "reset": "mtp_hooks.testing",
    # the parameter editors: they change the model's weights, not what a forward runs
    "freeze_mtp": "mtp_hooks.megatron",
    "freeze_trunk": "mtp_hooks.megatron",
    "clip_mtp_apart": "mtp_hooks.megatron",
}


def __getattr__(name: str) -> Any:
    # The version is read from the installed distribution when asked for.
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("mtp-hooks")
        except PackageNotFoundError:
            return "0+unknown"
    home = _ELSEWHERE.get(name)
    hint = f"; import it from {home}" if home is not None else ""
    raise AttributeError(f"module 'mtp_hooks' has no attribute {name!r}{hint}")


def __dir__() -> list[str]:
    """The module's names, with ``__version__`` (read when asked for)."""
    return sorted(set(globals()) | {"__version__"})

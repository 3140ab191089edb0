"""The plugin registry: a lazily built ``pluggy.PluginManager`` behind one typed facade.

Nothing here runs at import time. The manager is created, and entry points of the ``mtp_hooks``
group are loaded, on first use. Callers go through :class:`PluginRegistry`
(:mod:`mtp_hooks._plugin_registry`), never ``pm.hook``.
"""

from __future__ import annotations

import pluggy

from . import _env, _runtime
from ._plugin_registry import ENV_DISABLE, ENV_DISABLE_AUTOLOAD, PluginInfo, PluginRegistry

__all__ = [
    "PluginInfo",
    "PluginRegistry",
    "get_plugin_manager",
    "register",
    "unregister",
    "list_plugins",
    "ENV_DISABLE",
    "ENV_DISABLE_AUTOLOAD",
]


def _registry() -> PluginRegistry:
    """Return the process-wide registry, creating it and loading entry points on first use."""
    runtime = _runtime.current
    registry = runtime.registry
    if registry is None:
        registry = PluginRegistry()
        if not _env.flag(ENV_DISABLE_AUTOLOAD):
            registry.load_entry_points()
        runtime.registry = registry
    return registry


def get_plugin_manager() -> pluggy.PluginManager:
    """Return the ``pluggy.PluginManager``, created lazily with entry points loaded."""
    return _registry().pm


def register(plugin: object, name: str | None = None) -> str:
    """Register a plugin object or module and return its name.

    Raises:
        PluginLoadError: The plugin implements an unknown hook or has a bad signature; nothing
            is left registered.

    Example:
        >>> import mtp_hooks
        >>> class NeverInRollout:
        ...     @mtp_hooks.hookimpl
        ...     def should_run_mtp(self, model, phase):
        ...         return False if phase == "rollout" else None
        >>> mtp_hooks.register(NeverInRollout(), name="never-in-rollout")
        'never-in-rollout'
    """
    return _registry().register(plugin, name)


def unregister(name_or_plugin: str | object) -> None:
    """Unregister a plugin by its name or by the object that was registered."""
    _registry().unregister(name_or_plugin)


def list_plugins() -> list[PluginInfo]:
    """Describe every registered or blocked plugin (what ``mtp-hooks plugins`` prints)."""
    return _registry().describe()

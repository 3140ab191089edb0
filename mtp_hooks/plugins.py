"""What a plugin author imports: the hook markers, registration, the reset callback, and what
a policy option is.

A plugin is any module or object with functions marked by :data:`hookimpl`, named after the
hooks of :mod:`mtp_hooks.hookspecs`. Register it with :func:`register`, or ship it as an entry
point of the ``mtp_hooks`` group; entry points are loaded all or nothing, the first time a
decision is made. Nothing here runs at import time.

A distribution may also contribute a policy option (``+name`` in a policy string): an
:class:`Option` subclass (a :class:`Flag` for a ``+name`` flag), shipped as an entry point of
the :data:`OPTIONS_GROUP` group under the option's name. Contributed options are loaded all or
nothing at the first parse or decision, after the built-in ones, and each is checked apart
from the others (name, table keys, spellings, fields, hooks); its :attr:`Option.hookspecs`
join mtp-hooks' own, so plugins may implement them. What the option does at a forward call is
its per-call extension (:attr:`Option.extension`, a kind of
:class:`mtp_hooks.megatron.CallExtension`); where a model's :class:`Layout` keeps the option
from its part, :meth:`Option.refusal` says why, and the model is refused at attach (or at the
plan, for what plugins set). docs/contributing.md walks through one.

Example:
    >>> from mtp_hooks.plugins import hookimpl, register, unregister
    >>> class NeverInRollout:
    ...     @hookimpl
    ...     def should_run_mtp(self, model, phase):
    ...         return False if phase == "rollout" else None
    >>> register(NeverInRollout(), name="never-in-rollout")
    'never-in-rollout'
    >>> unregister("never-in-rollout")
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, Final

import pluggy

from . import _contributed_options, _options, _runtime
from ._contributed_options import OptionInfo
from ._errors import about
from ._option_base import NOTHING, Ask, Asked, Flag, Layout, Option, PlanPart
from ._plugin_registry import ENV_DISABLE, ENV_DISABLE_AUTOLOAD, PluginInfo, registry
from ._roles import role_of
from .hookspecs import hookimpl, hookspec

OPTIONS_GROUP: Final = _contributed_options.GROUP
"""The entry-point group under which a distribution ships a policy option of its own
(``mtp_hooks.options``); the entry point's name is the option's."""

__all__ = [
    "ENV_DISABLE",
    "ENV_DISABLE_AUTOLOAD",
    "NOTHING",
    "OPTIONS_GROUP",
    "Ask",
    "Asked",
    "Flag",
    "Layout",
    "Option",
    "OptionInfo",
    "PlanPart",
    "PluginInfo",
    "get_plugin_manager",
    "answers",
    "hookimpl",
    "hookspec",
    "implements",
    "list_options",
    "list_plugins",
    "on_reset",
    "register",
    "unregister",
]


def register(plugin: object, name: str | None = None) -> str:
    """Register a plugin object or module and return its name.

    Raises:
        PluginError: The plugin implements an unknown hook, has a bad signature, or is
            registered already; nothing is left registered.
    """
    return registry().register(plugin, name)


def unregister(name_or_plugin: str | object) -> None:
    """Unregister a plugin by its name or by the object that was registered.

    Raises:
        UnknownPluginError: No such plugin is registered.
    """
    registry().unregister(name_or_plugin)


def answers(hook: str, **arguments: Any) -> dict[str, Any]:
    """Call ``hook`` on each registered plugin that implements it, one plugin at a time, and
    return their answers by plugin name, abstentions (``None``) left out.

    What a contributed option's per-call extension uses to call a hook its option declares
    (:attr:`Option.hookspecs`) at a forward, as ``+metrics`` hands its figures to
    ``mtp_metrics``. Where ``arguments`` hold ``model`` and ``phase``, an mtp-hooks error a
    plugin raises names that phase and the model's role.

    Raises:
        PluginError: A plugin raised (the message names it and how to disable it, and the
            plugins after it are not called), or no hookspec declares ``hook``.

    Example:
        >>> from mtp_hooks.plugins import answers, hookimpl, register, unregister
        >>> class Phases:
        ...     @hookimpl
        ...     def declare_phases(self):
        ...         return ["rollout_eval"]
        >>> register(Phases(), name="phases")
        'phases'
        >>> answers("declare_phases")
        {'phases': ['rollout_eval']}
        >>> unregister("phases")
    """
    found = registry()
    found.declared(hook)
    named = "model" in arguments and "phase" in arguments
    culprit = (
        about(phase=str(arguments["phase"]), role=role_of(arguments["model"]))
        if named
        else nullcontext()
    )
    with culprit:
        called = found.answers(hook, **arguments)
    return {name: answer for name, answer in called if answer is not None}


def implements(hook: str) -> bool:
    """Whether any registered plugin implements ``hook``: an extension asks before it makes
    what only a plugin would read.

    Example:
        >>> from mtp_hooks.plugins import implements
        >>> implements("mtp_loss_mask")
        False
    """
    return registry().implements(hook)


def list_plugins() -> list[PluginInfo]:
    """Describe every registered or blocked plugin (what ``mtp-hooks plugins`` prints)."""
    return registry().describe()


def list_options() -> list[OptionInfo]:
    """Describe every policy option in force, mtp-hooks' own and those installed distributions
    contribute, in the order the parser reads them (what ``mtp-hooks options`` prints).

    Raises:
        PluginError: A contributed option does not load or clashes with another.

    Example:
        >>> from mtp_hooks.plugins import list_options
        >>> [(info.written, info.distribution) for info in list_options()][:2]
        [(('run:WEIGHT',), None), (('+metrics',), None)]
    """
    return _contributed_options.describe(_options.options(), _options.OPTIONS)


def get_plugin_manager() -> pluggy.PluginManager:
    """Return the ``pluggy.PluginManager``, created lazily with entry points loaded.

    Use it for what pluggy offers (``list_name_plugin``, ``enable_tracing``,
    ``add_hookcall_monitoring``): every hook call goes through it, one call per plugin, so a
    monitor sees each plugin's answer. Register and unregister through :func:`register` and
    :func:`unregister`, which validate the plugin and tell the gates.
    """
    return registry().pm


def on_reset(callback: Callable[[], None]) -> None:
    """Have :func:`mtp_hooks.testing.reset` call ``callback`` before it starts over.

    A plugin that keeps settings of its own registers a callback that drops them, so that a
    test suite's reset between tests covers the plugin too. A bound method is held weakly;
    :class:`mtp_hooks.framework.RoleSettings` registers its ``reset`` by itself.

    Example:
        >>> from mtp_hooks.plugins import on_reset
        >>> from mtp_hooks.testing import reset
        >>> settings = {"skip_eval": True}
        >>> on_reset(settings.clear)
        >>> reset()
        >>> settings
        {}
    """
    _runtime.on_reset(callback)

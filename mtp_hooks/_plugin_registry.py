"""The plugin registry: a ``pluggy.PluginManager`` with typed calls of each hook, entry-point
loading and the checks every plugin passes; :func:`registry` returns the process's one.

It is the only code that calls hooks. It calls them through pluggy, one plugin at a time (a
``subset_hook_caller`` per plugin), so that pluggy's tracing and
``PluginManager.add_hookcall_monitoring`` see every call with the plugin that answered, and so
that each answer, abstentions included, is known by plugin name. An exception a plugin raises
becomes a :class:`mtp_hooks.PluginError` naming the plugin and how to disable it. Plugin authors
use :mod:`mtp_hooks.plugins`, the public face of this module.
"""

from __future__ import annotations

import importlib.metadata
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import pluggy

from . import _env, _options, _runtime, hookspecs
from ._contributed_options import distribution_of, hook_names
from ._errors import PluginError, UnknownPluginError, about
from ._plugin_checks import (
    all_cacheable,
    check_plugin,
    check_vote,
    declared_phases,
)

if TYPE_CHECKING:
    from ._forward_call import ForwardCall

ENV_DISABLE_AUTOLOAD, ENV_DISABLE = _env.ENV_DISABLE_AUTOLOAD, _env.ENV_DISABLE


class PluginCaller(NamedTuple):
    """One plugin's implementation of one hook, and pluggy's caller of it alone."""

    name: str
    call: pluggy.HookCaller


@dataclass(frozen=True)
class PluginInfo:
    """What ``mtp-hooks plugins`` reports for one plugin."""

    name: str
    distribution: str | None
    version: str | None
    hooks: tuple[str, ...]
    blocked: bool = False


def registry() -> PluginRegistry:
    """The process's registry, built (with the entry points loaded) at first use."""
    runtime = _runtime.current
    found: PluginRegistry | None = runtime.registry
    if found is None:
        found = PluginRegistry()
        if not _env.flag(ENV_DISABLE_AUTOLOAD):
            found.load_entry_points()
        runtime.registry = found
    return found


class PluginRegistry:
    """Typed facade over the plugin manager; the only code that calls hooks."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        for option in _options.options():  # checked apart when they were loaded
            if option.hookspecs is not None:
                self.pm.add_hookspecs(option.hookspecs)
        self._dists: dict[str, tuple[str, str]] = {}
        self._blocked_eps: dict[str, tuple[str | None, str | None]] = {}
        self._phases: frozenset[str] | None = None  # both derived from the plugins, and
        self._cacheable: bool | None = None  # cleared when they change
        # per hook: the implementations the callers were made for, and the callers
        self._callers: dict[str, tuple[tuple[Any, ...], tuple[PluginCaller, ...]]] = {}
        for name in _env.blocked_names():
            self.pm.set_blocked(name)

    # -- loading -----------------------------------------------------------------------------
    def load_entry_points(self) -> None:
        """Load every ``mtp_hooks`` entry point; on any failure, register none of them.

        This follows ``PluginManager.load_setuptools_entrypoints`` (same group, blocked names
        skipped, entry-point name as plugin name) but loads one entry point at a time, so that a
        failure can name the entry point and its distribution and undo what was registered.
        """
        loaded: list[str] = []
        try:
            for ep in importlib.metadata.entry_points(group=hookspecs.PROJECT_NAME):
                dist_name, dist_version = distribution_of(ep)
                if self.pm.is_blocked(ep.name):
                    self._blocked_eps[ep.name] = (dist_name, dist_version)
                    continue
                if self.pm.get_plugin(ep.name) is not None:
                    continue
                try:
                    plugin = ep.load()
                    if inspect.isclass(plugin):
                        plugin = plugin()
                    self.register(plugin, name=ep.name)
                except Exception as exc:
                    raise PluginError(
                        plugin=ep.name,
                        message=f"mtp_hooks plugin {ep.name!r} (entry point {ep.value!r} of "
                        f"distribution {dist_name or '?'} {dist_version or '?'}) failed to load: "
                        f"{type(exc).__name__}: {exc}. Fix or uninstall it, or disable it with "
                        f"{ENV_DISABLE}={ep.name} (or {ENV_DISABLE_AUTOLOAD}=1 for all plugins).",
                    ) from exc
                loaded.append(ep.name)
                if dist_name is not None:
                    self._dists[ep.name] = (dist_name, dist_version or "?")
            self.check_pending()
        except PluginError:
            for name in loaded:
                self.pm.unregister(name=name)
                self._dists.pop(name, None)
            raise

    def hook_names(self) -> list[str]:
        """Every hook mtp-hooks defines, in the order :mod:`mtp_hooks.hookspecs` declares them,
        then those the contributed policy options declare."""
        own = hook_names(hookspecs)
        for option in _options.options():
            if option.hookspecs is not None:
                own += hook_names(option.hookspecs)
        return own

    def check_pending(self) -> None:
        """Raise :class:`PluginError` for a hookimpl that matches no hookspec (a typo)."""
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            name = self.pm.get_name(exc.plugin) or repr(exc.plugin)
            dist = self._dists.get(name)
            origin = f" (distribution {dist[0]} {dist[1]})" if dist else ""
            raise PluginError(
                plugin=name,
                message=f"mtp_hooks plugin {name!r}{origin} implements a hook mtp-hooks does not "
                f"define: {exc}. Known hooks: {', '.join(self.hook_names())}. Fix the name, or "
                f"disable the plugin with {ENV_DISABLE}={name}.",
            ) from exc

    # -- registration ------------------------------------------------------------------------
    def register(self, plugin: object, name: str | None = None) -> str:
        """Register ``plugin`` and validate its hooks; nothing stays registered on failure."""
        label = name or repr(plugin)
        with about(plugin=name):
            check_plugin(self.pm, plugin, label)
        if name is not None and self.pm.is_blocked(name):
            raise PluginError(
                f"mtp_hooks plugin {name!r} is blocked by {ENV_DISABLE}; unset it to register",
                plugin=name,
            )
        try:
            registered = self.pm.register(plugin, name=name)
            if registered is None:
                raise PluginError(
                    f"mtp_hooks plugin {label} is blocked by {ENV_DISABLE}; unset it to register",
                    plugin=name,
                )
            self.check_pending()
        except ValueError as exc:  # already registered under this name or object
            raise PluginError(
                f"cannot register mtp_hooks plugin {label}: {exc}", plugin=name
            ) from exc
        except pluggy.PluginValidationError as exc:
            self._discard(plugin, name)
            raise PluginError(f"invalid mtp_hooks plugin {label}: {exc}", plugin=name) from exc
        except PluginError as exc:
            self._discard(plugin, name)
            exc.fill(plugin=name)
            raise
        self._changed()
        return registered

    def _discard(self, plugin: object, name: str | None) -> None:
        """Undo a registration that pluggy left half done (it keeps the name on some versions)."""
        if self.pm.is_registered(plugin):
            self.pm.unregister(plugin)
        elif name is not None and self.pm.has_plugin(name):
            self.pm.unregister(name=name)

    def unregister(self, name_or_plugin: str | object) -> None:
        """Unregister a plugin given by name or by object.

        Raises:
            UnknownPluginError: No such plugin is registered.
        """
        by_name = isinstance(name_or_plugin, str)
        name = (
            name_or_plugin if isinstance(name_or_plugin, str) else self.pm.get_name(name_or_plugin)
        )
        if name is None or self.pm.get_plugin(name) is None:
            what = "no plugin named {!r} is" if by_name else "{!r} is not"
            raise UnknownPluginError(
                f"unregister: {what.format(name_or_plugin)} registered; "
                "mtp_hooks.plugins.list_plugins() lists the registered ones",
                plugin=name_or_plugin if isinstance(name_or_plugin, str) else None,
            )
        self.pm.unregister(name=name)
        self._dists.pop(name, None)
        self._changed()

    def _changed(self) -> None:
        self._phases = self._cacheable = None
        _runtime.advance()

    # -- hook calls --------------------------------------------------------------------------
    def votes(
        self, model: Any, phase: Any, call: ForwardCall | None = None
    ) -> list[tuple[str, bool | None]]:
        """Call ``should_run_mtp`` on every plugin and return ``(plugin name, vote)`` pairs;
        ``call``: the forward being decided, if any.

        Raises:
            PluginError: A plugin raised; its exception is chained and the plugin is named.
            PolicyError: A plugin returned something other than ``True``, ``False`` or ``None``.
        """
        return [
            (name, check_vote(name, "should_run_mtp", vote))
            for name, vote in self._answers("should_run_mtp", model=model, phase=phase, call=call)
        ]

    def answers(self, hook: str, **arguments: Any) -> list[tuple[str, Any]]:
        """Call ``hook`` with ``arguments`` on every plugin; return ``(plugin name, answer)``
        pairs, ``None`` for an abstention, unchecked: a policy option's hook
        (``mtp_loss_scale``, ``mtp_detach_heads``, ``mtp_objective``) is checked by its option
        (:meth:`mtp_hooks._options.Option.answer`), and :func:`mtp_hooks.plugins.answers`
        hands any declared hook's answers on."""
        return self._answers(hook, **arguments)

    def declared(self, hook: str) -> None:
        """Refuse a ``hook`` that no hookspec declares, naming the known ones."""
        caller = getattr(self.pm.hook, hook, None)
        if caller is None or caller.spec is None:
            raise PluginError(
                f"mtp_hooks: no hookspec declares the hook {hook!r}, so no plugin can answer "
                f"it; the hooks are {', '.join(self.hook_names())} (a policy option declares "
                "its own through Option.hookspecs)",
                hook=hook,
            )

    def loss_masks(self, model: Any, phase: Any, **tensors: Any) -> list[tuple[str, Any]]:
        """Call ``mtp_loss_mask`` on every plugin with ``tensors`` (``loss_mask``, ``labels``,
        ``input_ids``); return ``(plugin name, mask)`` for each plugin that gave one."""
        answers = self._answers("mtp_loss_mask", model=model, phase=phase, **tensors)
        return [(name, mask) for name, mask in answers if mask is not None]

    def _answers(self, hook: str, **arguments: Any) -> list[tuple[str, Any]]:
        """Each plugin's answer to ``hook`` by name, ``None`` for an abstention."""
        return [(c.name, _call(c, hook, arguments)) for c in self.callers(hook)]

    def callers(self, hook: str) -> tuple[PluginCaller, ...]:
        """pluggy's caller of each implementation of ``hook`` on its own, in pluggy's order.

        Made again whenever the implementations change, also when a plugin was registered
        on the plugin manager directly.
        """
        impls = tuple(getattr(self.pm.hook, hook).get_hookimpls())
        made = self._callers.get(hook)
        if made is not None and made[0] == impls:
            return made[1]
        plugins = [impl.plugin for impl in impls]
        callers = tuple(
            PluginCaller(
                impl.plugin_name,
                self.pm.subset_hook_caller(hook, [p for p in plugins if p is not impl.plugin]),
            )
            for impl in impls
        )
        self._callers[hook] = (impls, callers)
        return callers

    def votes_cacheable(self) -> bool:
        """Whether every ``should_run_mtp`` implementation is declared ``cacheable_vote``."""
        if self._cacheable is None:
            self._cacheable = all_cacheable(self.pm.hook.should_run_mtp.get_hookimpls())
        return self._cacheable

    def implements(self, hook: str) -> bool:
        """Whether any registered plugin implements ``hook``."""
        return bool(getattr(self.pm.hook, hook).get_hookimpls())

    def implementers(self, hook: str) -> list[str]:
        """The names of the registered plugins that implement ``hook``, sorted."""
        return sorted(i.plugin_name for i in getattr(self.pm.hook, hook).get_hookimpls())

    def plugin_phases(self) -> frozenset[str]:
        """Custom phase names declared by plugins through ``declare_phases`` (cached)."""
        if self._phases is None:
            self._phases = declared_phases(self._answers("declare_phases"))
        return self._phases

    def describe(self) -> list[PluginInfo]:
        """Every registered plugin, then every blocked entry point, sorted by name."""
        infos = []
        for name, plugin in self.pm.list_name_plugin():
            if plugin is None:
                continue
            hooks = tuple(sorted(h.name for h in self.pm.get_hookcallers(plugin) or ()))
            dist, version = self._dists.get(name, (None, None))
            infos.append(PluginInfo(name, dist, version, hooks))
        for name, (dist, version) in self._blocked_eps.items():
            infos.append(PluginInfo(name, dist, version, (), blocked=True))
        for name in _env.blocked_names():
            if name not in self._blocked_eps:
                infos.append(PluginInfo(name, None, None, (), blocked=True))
        return sorted(infos, key=lambda i: i.name)


def _call(caller: PluginCaller, hook: str, arguments: dict[str, Any]) -> Any:
    """Call one plugin's ``hook`` through pluggy; its answer, ``None`` if it abstained.

    An exception becomes :class:`PluginError` naming the plugin.
    """
    try:
        answers = caller.call(**arguments)
    except Exception as exc:
        raise PluginError(
            f"mtp_hooks plugin {caller.name!r}: {hook} raised {type(exc).__name__}: {exc}. "
            f"Fix the plugin, or disable it with {ENV_DISABLE}={caller.name}.",
            plugin=caller.name,
            hook=hook,
        ) from exc
    return answers[0] if answers else None

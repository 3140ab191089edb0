"""What the registry checks of plugins: that an object is one, how it hooks in, its answers,
its phases, whether its votes may be cached."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import pluggy

from ._errors import PluginError, PolicyError
from .hookspecs import OBJECTIVES

F = TypeVar("F", bound=Callable[..., Any])


def check_plugin(pm: pluggy.PluginManager, plugin: object, label: str) -> None:
    """Refuse, with :class:`PluginError`, what cannot be an mtp-hooks plugin.

    That is ``None`` and plain values, an object with no ``@mtp_hooks.plugins.hookimpl`` function (a
    forgotten decorator, or a marker of another project), and hook wrappers, whose effect on
    the per-plugin votes mtp-hooks counts by name would go unseen.
    """
    if plugin is None or isinstance(plugin, (str, bytes, int, float, bool)):
        raise PluginError(
            f"cannot register {plugin!r} as an mtp_hooks plugin: pass a module, a class "
            "instance or another object whose hook functions carry @mtp_hooks.plugins.hookimpl"
        )
    options = hook_options(pm, plugin)
    if not options:
        raise PluginError(
            f"mtp_hooks plugin {label}: implements no mtp_hooks hook; decorate its "
            "should_run_mtp or declare_phases with @mtp_hooks.plugins.hookimpl (a hookimpl "
            "marker of another project name is not seen)"
        )
    wrappers = sorted(n for n, o in options.items() if o.get("hookwrapper") or o.get("wrapper"))
    if wrappers:
        raise PluginError(
            f"mtp_hooks plugin {label}: {', '.join(wrappers)} is declared as a hook wrapper; "
            "mtp-hooks counts each plugin's own vote by name, so a wrapper could change "
            "votes unseen. Drop wrapper=True/hookwrapper=True and return True (run), False "
            "(skip) or None (abstain).",
            hook=wrappers[0],
        )


def hook_options(pm: pluggy.PluginManager, plugin: object) -> dict[str, dict[str, Any]]:
    """The hookimpl options of every attribute of ``plugin`` marked for this project."""
    found: dict[str, dict[str, Any]] = {}
    for attr in dir(plugin):
        try:
            opts = pm.parse_hookimpl_opts(plugin, attr)
        except Exception:  # an attribute that raises on access is no hook
            opts = None
        if opts is not None:
            found[opts.get("specname") or attr] = dict(opts)
    return found


def check_vote(plugin: str, hook: str, vote: Any) -> bool | None:
    """``vote``, once it is ``True``, ``False`` or ``None`` (abstain); else :class:`PolicyError`
    naming the plugin and the hook."""
    if vote is not None and not isinstance(vote, bool):
        raise PolicyError(
            f"plugin {plugin!r}: {hook} returned {vote!r}; it must return True, False or None "
            "(abstain)",
            plugin=plugin,
            hook=hook,
        )
    return vote


def check_objective(plugin: str, answer: Any) -> str | None:
    """``answer`` to ``mtp_objective``, once it is one of the objectives or ``None``."""
    if answer is not None and answer not in OBJECTIVES:
        raise PolicyError(
            f"plugin {plugin!r}: mtp_objective returned {answer!r}; it must return "
            "'ce', 'kl', 'tv' or None (abstain)",
            plugin=plugin,
            hook="mtp_objective",
        )
    return None if answer is None else str(answer)


def declared_phases(answers: Iterable[tuple[str, Any]]) -> frozenset[str]:
    """The phase names of the ``declare_phases`` answers, ``(plugin name, answer)`` pairs,
    validated by plugin.

    Raises:
        PolicyError: Naming the plugin, for a bare string, a non-iterable or a name that is not
            an identifier.
    """
    names: set[str] = set()
    for plugin, result in answers:
        if result is None:
            continue
        if isinstance(result, (str, bytes)) or not isinstance(result, Iterable):
            raise PolicyError(
                f"mtp_hooks plugin {plugin!r}: declare_phases returned "
                f"{result!r}; return a list of phase names, e.g. [{result!r}]",
                plugin=plugin,
                hook="declare_phases",
            )
        for name in result:
            if not isinstance(name, str) or not name.isidentifier():
                raise PolicyError(
                    f"mtp_hooks plugin {plugin!r}: declare_phases returned "
                    f"the invalid phase name {name!r}; use identifiers such as 'distill'",
                    plugin=plugin,
                    hook="declare_phases",
                )
            names.add(name)
    return frozenset(names)


CACHEABLE_VOTE = "mtp_hooks_cacheable_vote"  # set by mark_cacheable


def mark_cacheable(hook: F) -> F:
    """Mark a ``should_run_mtp`` implementation as a cacheable vote (see
    :func:`mtp_hooks.framework.cacheable_vote`)."""
    setattr(hook, CACHEABLE_VOTE, True)
    return hook


def all_cacheable(impls: list[Any]) -> bool:
    """Whether every implementation in ``impls`` is declared ``cacheable_vote``."""
    return all(getattr(impl.function, CACHEABLE_VOTE, False) for impl in impls)

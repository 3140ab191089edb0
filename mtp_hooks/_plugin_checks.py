"""What ``register()`` checks before pluggy sees a plugin: that it is one, and how it hooks in."""

from __future__ import annotations

from typing import Any

import pluggy

from ._errors import PluginLoadError


def check_plugin(pm: pluggy.PluginManager, plugin: object, label: str) -> None:
    """Refuse, with :class:`PluginLoadError`, what cannot be an mtp-hooks plugin.

    That is ``None`` and plain values, an object with no ``@mtp_hooks.hookimpl`` function (a
    forgotten decorator, or a marker of another project), and hook wrappers, whose effect on
    the per-plugin votes mtp-hooks counts by name would go unseen.
    """
    if plugin is None or isinstance(plugin, (str, bytes, int, float, bool)):
        raise PluginLoadError(
            f"cannot register {plugin!r} as an mtp_hooks plugin: pass a module, a class "
            "instance or another object whose hook functions carry @mtp_hooks.hookimpl"
        )
    options = hook_options(pm, plugin)
    if not options:
        raise PluginLoadError(
            f"mtp_hooks plugin {label}: implements no mtp_hooks hook; decorate its "
            "should_run_mtp or declare_phases with @mtp_hooks.hookimpl (a hookimpl marker of "
            "another project name is not seen)"
        )
    wrappers = sorted(n for n, o in options.items() if o.get("hookwrapper") or o.get("wrapper"))
    if wrappers:
        raise PluginLoadError(
            f"mtp_hooks plugin {label}: {', '.join(wrappers)} is declared as a hook wrapper; "
            "mtp-hooks counts each plugin's own vote by name, so a wrapper could change "
            "votes unseen. Drop wrapper=True/hookwrapper=True and return True (run), False "
            "(skip) or None (abstain)."
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

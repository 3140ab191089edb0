"""The environment switches of mtp-hooks: how an on/off switch reads (``1``, ``true``, ``yes``
or ``on``), and the two that keep installed distributions' code out: autoload keeps every
plugin out, a name keeps that plugin or contributed policy option out."""

from __future__ import annotations

import os

_ON = frozenset({"1", "true", "yes", "on"})

ENV_DISABLE_AUTOLOAD = "MTP_HOOKS_DISABLE_PLUGIN_AUTOLOAD"
"""On: no plugin is loaded from the ``mtp_hooks`` entry-point group; plugins come in only by
``mtp_hooks.register``. Contributed policy options (``mtp_hooks.options``) still load: they
change no job until a policy writes them, and the plugins a job registers by hand may answer
their hooks."""
ENV_DISABLE = "MTP_HOOKS_DISABLE"
"""Comma-separated entry-point names that are not loaded (plugins and options alike)."""


def flag(name: str) -> bool:
    """Whether the environment variable ``name`` is set to an "on" value (case-insensitive)."""
    return os.environ.get(name, "").strip().lower() in _ON


def blocked_names() -> list[str]:
    """The entry-point names :data:`ENV_DISABLE` lists."""
    return [n.strip() for n in os.environ.get(ENV_DISABLE, "").split(",") if n.strip()]

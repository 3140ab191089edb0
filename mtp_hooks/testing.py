"""Helpers for the test suites of frameworks and plugins that use mtp-hooks."""

from __future__ import annotations

from . import _runtime

__all__ = ["reset"]


def reset() -> None:
    """Return mtp-hooks to a fresh state between tests.

    First every callback registered with :func:`mtp_hooks.plugins.on_reset` runs (plugins drop
    their settings; every :class:`mtp_hooks.framework.RoleSettings` is cleared), and auto-attach
    stops watching for new models. Then the plugin manager, the policy config, the declared
    phases and the roles start over: the next use builds a new plugin manager and reloads entry
    points, those of contributed policy options included. Hooks already attached to models
    stay attached; remove them with ``handle.remove()``.

    Example:
        >>> import mtp_hooks
        >>> from mtp_hooks.testing import reset
        >>> mtp_hooks.configure("eval=skip")
        >>> reset()
        >>> mtp_hooks.decide(None, "eval").decided_by
        'default'
    """
    _runtime.run_reset_callbacks()
    auto = _runtime.process.auto
    if auto.registration is not None:
        auto.registration.remove()
        auto.registration = None
    _runtime.replace()

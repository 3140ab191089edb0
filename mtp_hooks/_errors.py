"""The exception hierarchy of mtp-hooks.

Every error the library raises derives from :class:`MTPHooksError`, so a framework can catch the
whole family with one ``except`` clause. Messages always name the culprit (phase, key, plugin or
Megatron setting) and the fix.
"""

from __future__ import annotations

__all__ = [
    "MTPHooksError",
    "PolicyError",
    "PolicyConflictError",
    "PluginLoadError",
    "PluginError",
    "UnsupportedModelError",
    "DecisionMismatchError",
]


class MTPHooksError(Exception):
    """Base class of every error raised by mtp-hooks."""


class PolicyError(MTPHooksError, ValueError):
    """A phase, a policy value or a policy source is malformed or unknown."""


class PolicyConflictError(MTPHooksError):
    """Plugins voted both ways for one (role, phase); the policy config must settle it."""


class PluginLoadError(MTPHooksError):
    """An entry-point plugin failed to import, to register or to validate."""


class PluginError(MTPHooksError):
    """A plugin's hook raised while deciding; the plugin's own exception is chained."""


class UnsupportedModelError(MTPHooksError, TypeError):
    """The model, or a Megatron mode it runs in, cannot be gated safely."""


class DecisionMismatchError(MTPHooksError):
    """Ranks that must agree on an MTP decision did not (``MTP_HOOKS_VERIFY``)."""

"""The exception hierarchy of mtp-hooks.

Every error the library raises derives from :class:`MTPHooksError`, so a framework can catch the
whole family with one ``except`` clause. They print as ``mtp_hooks.PolicyError`` and so on, the
name they are imported by. Messages always name the culprit (phase, key, plugin or
Megatron setting) and the fix.
"""

from __future__ import annotations


class MTPHooksError(Exception):
    """Base class of every error raised by mtp-hooks."""

    __module__ = "mtp_hooks"


class PolicyError(MTPHooksError, ValueError):
    """A phase, a policy value or a policy source is malformed or unknown."""

    __module__ = "mtp_hooks"


class PolicyConflictError(MTPHooksError):
    """Two sources disagree for one (role, phase): plugins voted both ways (the policy
    config must settle it), or a caller passed ``compute_mtp_loss=False`` to a call whose
    decision asks for more than a skip (``+metrics``, ``+objective``, a weight, ``+detach``,
    ``+mask:labels``)."""

    __module__ = "mtp_hooks"


class UnknownPluginError(MTPHooksError, LookupError):
    """No plugin is registered under the name, or as the object, given to ``unregister``."""

    __module__ = "mtp_hooks"


class PluginError(MTPHooksError):
    """A plugin failed: to import, to register or to validate (entry points are then loaded
    none at all), or its hook raised while deciding (the plugin's own exception is chained)."""

    __module__ = "mtp_hooks"


class UnsupportedModelError(MTPHooksError, TypeError):
    """The model, or a Megatron mode it runs in, cannot be gated safely."""

    __module__ = "mtp_hooks"


class DecisionMismatchError(MTPHooksError):
    """Ranks that must agree on an MTP decision did not (``MTP_HOOKS_VERIFY``)."""

    __module__ = "mtp_hooks"

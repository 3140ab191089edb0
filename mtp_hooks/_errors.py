"""The exception hierarchy of mtp-hooks.

Every error the library raises derives from :class:`MTPHooksError`, so a framework can catch the
whole family with one ``except`` clause. They print as ``mtp_hooks.PolicyError`` and so on, the
name they are imported by. Messages always name the culprit (phase, key, plugin or
Megatron setting) and the fix, and each error carries the same culprit as attributes, so that a
framework can act on it without reading the message.

Example:
    >>> import mtp_hooks
    >>> try:
    ...     mtp_hooks.configure("train=run,teacher.eval=skp")
    ... except mtp_hooks.PolicyError as error:
    ...     print(error.role, error.phase, error.option, error.source)
    teacher eval skp mtp_hooks.configure()
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any

__all__ = [
    "DecisionMismatchError",
    "MTPHooksError",
    "PluginError",
    "PolicyConflictError",
    "PolicyError",
    "UnknownPluginError",
    "UnsupportedModelError",
    "about",
]

_FIELDS = ("phase", "role", "option", "source", "plugin", "hook")


class MTPHooksError(Exception):
    """Base class of every error raised by mtp-hooks.

    Besides its message, an error names its culprit in attributes, each ``None`` where it does
    not apply or is not known:

    Attributes:
        phase: The phase the error is about (``"eval"``, or a declared custom phase).
        role: The role of the policy entry or model (``"teacher"``).
        option: The policy value or option at fault, as given (``"skp"``, ``"+detatch"``,
            ``"+mask:labels"``), or what a refusal could not apply.
        source: Where the policy came from, as messages name it
            (``"mtp_hooks.configure()"``, ``"MTP_HOOKS_POLICY='eval=skp'"``, a policy file's
            path).
        plugin: The plugin at fault, by its registered name.
        hook: The hook that plugin answered or raised in (``"should_run_mtp"``).
    """

    __module__ = "mtp_hooks"

    phase: str | None
    role: str | None
    option: str | None
    source: str | None
    plugin: str | None
    hook: str | None

    def __init__(
        self,
        message: str,
        *,
        phase: str | None = None,
        role: str | None = None,
        option: str | None = None,
        source: str | None = None,
        plugin: str | None = None,
        hook: str | None = None,
    ) -> None:
        super().__init__(message)
        self.phase, self.role, self.option = phase, role, option
        self.source, self.plugin, self.hook = source, plugin, hook

    def culprit(self) -> dict[str, str | None]:
        """The attributes that name the culprit, by name: what an error raised in place of
        this one passes on (``raise UnsupportedModelError(message, **error.culprit())``)."""
        return {name: getattr(self, name) for name in _FIELDS}

    def fill(self, **known: str | None) -> None:
        """Set each attribute of ``known`` that is still ``None``: what an outer caller knows
        of the culprit that the code which raised did not."""
        for name, value in known.items():
            if name not in _FIELDS:
                raise TypeError(f"{type(self).__name__}.fill: unknown attribute {name!r}")
            if getattr(self, name) is None:
                setattr(self, name, value)

    def __reduce__(self) -> tuple[Any, ...]:
        # pickling rebuilds from args alone; keep the attributes across processes (Ray, spawn)
        return (_rebuild, (type(self), self.args, self.__dict__))


def _rebuild(kind: type[MTPHooksError], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    error = kind.__new__(kind)
    error.args = args
    error.__dict__.update(state)
    return error


@contextmanager
def about(**known: str | None) -> Iterator[None]:
    """Within the block, an :class:`MTPHooksError` raised gets each attribute of ``known`` that
    it left ``None`` (:meth:`MTPHooksError.fill`)."""
    try:
        yield
    except MTPHooksError as error:
        error.fill(**known)
        raise


class PolicyError(MTPHooksError, ValueError):
    """A phase, a policy value or a policy source is malformed or unknown.

    Attributes:
        errors: Where one source had several errors, each as a :class:`PolicyError` of its own
            (its attributes name its own culprit); empty for a single error.
    """

    __module__ = "mtp_hooks"

    errors: tuple[PolicyError, ...] = ()

    def fill(self, **known: str | None) -> None:
        """As :meth:`MTPHooksError.fill`, for this error and each of :attr:`errors`."""
        super().fill(**known)
        for error in self.errors:
            error.fill(**known)


class PolicyConflictError(MTPHooksError):
    """Two sources disagree for one (role, phase): plugins voted both ways (the policy
    config must settle it), or a caller passed ``compute_mtp_loss=False`` to a call whose
    decision asks for more than a skip (``+metrics``, ``+objective``, a weight, ``+detach``,
    ``+mask:labels``).

    Attributes:
        answers: For plugins that disagree, each one's answer by plugin name; ``hook`` names
            the hook they answered.
    """

    __module__ = "mtp_hooks"

    answers: Mapping[str, Any] = MappingProxyType({})


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

"""Reading a framework's own config: plain dicts, OmegaConf nodes or dataclasses, read alike.

Every reader fails with a :class:`mtp_hooks.PolicyError` that names the key, the bad value and
what is expected, before any policy changes. :class:`RoleSettings` keeps what a plugin was
configured with, by model role.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Generic, TypeVar

from .. import _runtime
from .._errors import PolicyError

T = TypeVar("T")

MISSING: Any = object()


def as_mapping(node: Any, where: str) -> Mapping[str, Any]:
    """Return ``node`` (a dict, an OmegaConf ``DictConfig`` or a dataclass) as a mapping.

    Mappings come back as they are, so an OmegaConf node resolves only the keys that are read
    (a framework's custom resolvers need not be registered for the others).

    Example:
        >>> from mtp_hooks.framework import as_mapping
        >>> as_mapping({"enable": True}, "actor_rollout_ref.model.mtp")
        {'enable': True}
    """
    if isinstance(node, Mapping):
        return node
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return dataclasses.asdict(node)
    raise PolicyError(
        f"{where}: expected a mapping (dict or OmegaConf node), got {type(node).__name__}"
    )


def read_key(
    config: Mapping[str, Any],
    key: str,
    types: type | tuple[type, ...],
    where: str,
    default: Any = MISSING,
) -> Any:
    """Read ``config[key]`` and check its type; ``bool`` never passes as ``int``.

    Raises:
        PolicyError: The key is missing (and has no default) or has the wrong type.

    Example:
        >>> from mtp_hooks.framework import read_key
        >>> read_key({"enable": True}, "enable", bool, "mtp")
        True
    """
    if key not in config or config[key] is None and default is not MISSING:
        if default is MISSING:
            raise PolicyError(f"{where}: missing key {key!r}")
        return default
    value = config[key]
    allowed = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool) and bool not in allowed or not isinstance(value, allowed):
        names = " or ".join(t.__name__ for t in allowed)
        raise PolicyError(f"{where}: key {key!r} must be {names}, got {value!r}")
    return value


class RoleSettings(Generic[T]):
    """A framework plugin's configured settings, by model role; ``None`` holds the default.

    Every instance is cleared by :func:`mtp_hooks.testing.reset`, so a plugin that keeps its
    settings here needs no reset code of its own.

    Example:
        >>> from mtp_hooks.framework import RoleSettings
        >>> settings = RoleSettings[str]()
        >>> settings.set("everyone")
        >>> settings.set("teachers only", role="teacher")
        >>> settings.get("teacher"), settings.get("student"), settings.get(None)
        ('teachers only', 'everyone', 'everyone')
    """

    def __init__(self) -> None:
        self._by_role: dict[str | None, T] = {}
        _runtime.on_reset(self.reset)

    def set(self, value: T, role: str | None = None) -> None:
        """Use ``value`` for models of ``role`` (``None``: every role without its own)."""
        self._by_role[role] = value
        _runtime.advance()

    def get(self, role: str | None) -> T | None:
        """The settings for ``role``, else the default, else ``None``."""
        found = self._by_role.get(role) if role is not None else None
        return found if found is not None else self._by_role.get(None)

    def reset(self) -> None:
        """Forget every setting (:func:`mtp_hooks.testing.reset` calls it)."""
        self._by_role.clear()
        _runtime.advance()

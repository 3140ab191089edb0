"""Helpers for framework plugins that turn a framework's own config into MTP decisions.

Frameworks hand their config over as plain dicts, OmegaConf nodes or dataclasses. These helpers
read them uniformly and fail with a :class:`mtp_hooks.PolicyError` that names the key, the bad
value and what is expected, before any policy changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ._errors import PolicyError

__all__ = ["as_mapping", "read_key", "MISSING"]

MISSING: Any = object()


def as_mapping(node: Any, where: str) -> dict[str, Any]:
    """Return ``node`` (a dict, an OmegaConf ``DictConfig`` or a dataclass) as a plain dict.

    Example:
        >>> from mtp_hooks.framework import as_mapping
        >>> as_mapping({"enable": True}, "actor_rollout_ref.model.mtp")
        {'enable': True}
    """
    if isinstance(node, Mapping):
        return dict(node)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return dataclasses.asdict(node)
    to_container = getattr(type(node), "to_container", None)  # OmegaConf DictConfig
    if to_container is None:
        try:
            from omegaconf import OmegaConf
        except ImportError:
            OmegaConf = None  # noqa: N806
        if OmegaConf is not None and OmegaConf.is_config(node):
            return dict(OmegaConf.to_container(node, resolve=True))
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

"""Model roles (``"teacher"``, ``"student"``...), held weakly: a role never keeps a model alive."""

from __future__ import annotations

from . import _runtime
from ._errors import PolicyError


def check_role(role: object, where: str) -> str:
    """Return ``role`` if it is an identifier, else raise :class:`PolicyError` from ``where``."""
    if not isinstance(role, str) or not role.isidentifier():
        raise PolicyError(f"{where}: role {role!r} is not an identifier such as 'teacher'")
    return role


def set_role(model: object, role: str | None) -> None:
    """Give ``model`` a role that the policy config (``ROLE.PHASE``) and plugins can see.

    Args:
        model: Any weak-referenceable object, usually an ``nn.Module``.
        role: An identifier such as ``"teacher"``, or ``None`` to clear the role.

    Example:
        >>> import torch, mtp_hooks
        >>> teacher = torch.nn.Linear(1, 1)
        >>> mtp_hooks.set_role(teacher, "teacher")
        >>> mtp_hooks.role_of(teacher)
        'teacher'
    """
    roles = _runtime.current.roles
    if role is None:
        roles.pop(model, None)
        _runtime.advance()
        return
    check_role(role, "set_role")
    try:
        roles[model] = role
        _runtime.advance()
    except TypeError as exc:
        raise PolicyError(
            f"set_role: {type(model).__name__} objects cannot be weakly referenced; "
            "pass the nn.Module itself"
        ) from exc


def role_of(model: object) -> str | None:
    """The role given to ``model`` by :func:`set_role` or ``attach(role=...)``, or ``None``."""
    if model is None:
        return None
    try:
        return _runtime.current.roles.get(model)
    except TypeError:
        return None

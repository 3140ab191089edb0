"""mtp-hooks plugin for Model-Optimizer (ModelOpt) distillation: ``freeze_mtp`` done per call.

With ``freeze_mtp`` on, the MTP forward and loss are skipped for both the ``teacher`` and the
``student`` in every phase, while the MTP weights stay in ``state_dict``, checkpoints and exports
(ModelOpt #2141 showed that dropping the heads breaks checkpoint loading). Together with
:func:`mtp_hooks.megatron.freeze_mtp` on the student, its MTP weights stay bit-identical across
optimizer steps. Teacher forwards nested inside the student's forward, as ``DistillationModel``
runs them, each get their own decision and restore.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import mtp_hooks
from mtp_hooks.framework import RoleSettings, as_mapping, read_key

__all__ = ["DistillMTPConfig", "configure", "current", "reset", "prepare_distillation", "ROLES"]

ROLES = ("teacher", "student")
WHERE = "modelopt distillation config"


@dataclass(frozen=True)
class DistillMTPConfig:
    """The part of a distillation setup that decides MTP."""

    freeze_mtp: bool

    def decide(self, role: str | None) -> bool | None:
        """Skip for teacher and student when frozen; abstain for other models."""
        if role in ROLES and self.freeze_mtp:
            return False
        return None


_settings: RoleSettings[DistillMTPConfig] = RoleSettings()


def configure(config: Any = None, *, freeze_mtp: bool | None = None) -> DistillMTPConfig:
    """Set the distillation MTP policy from ``{"freeze_mtp": bool}`` or the keyword.

    Raises:
        mtp_hooks.PolicyError: ``freeze_mtp`` missing or not a bool, or given twice.

    Example:
        >>> import mtp_hooks_modelopt
        >>> mtp_hooks_modelopt.configure(freeze_mtp=True)
        DistillMTPConfig(freeze_mtp=True)
    """
    if config is not None and freeze_mtp is not None:
        raise mtp_hooks.PolicyError(f"{WHERE}: give freeze_mtp either in the config or as keyword")
    cfg: Mapping[str, Any]
    if config is None:
        cfg = {} if freeze_mtp is None else {"freeze_mtp": freeze_mtp}
    else:
        cfg = as_mapping(config, WHERE)
    value = read_key(cfg, "freeze_mtp", bool, WHERE)
    result = DistillMTPConfig(value)
    _settings.set(result)
    return result


def current() -> DistillMTPConfig | None:
    """The configured policy, or ``None`` before :func:`configure` (the plugin abstains)."""
    return _settings.get(None)


def reset() -> None:
    """Forget the configured policy (``mtp_hooks.testing.reset()`` does it too)."""
    _settings.reset()


def prepare_distillation(student: Any, teacher: Any, *, freeze_mtp: bool = True) -> list[Any]:
    """Configure, freeze the student's MTP weights and attach both models with their roles.

    Call it on the bare models, before the student is wrapped in DDP (``freeze_mtp`` takes the
    MTP parameters out of the gradient buckets, so no zero-gradient trick is needed).

    Returns:
        The two :class:`mtp_hooks.AttachHandle` objects, student first.
    """
    configure(freeze_mtp=freeze_mtp)
    if freeze_mtp:
        mtp_hooks.megatron.freeze_mtp(student)
        mtp_hooks.megatron.freeze_mtp(teacher)
    return [mtp_hooks.attach(student, role="student"), mtp_hooks.attach(teacher, role="teacher")]

"""mtp-hooks plugin for NeMo-RL and Megatron-Bridge: MTP in the policy update only.

NeMo-RL copies ``policy.megatron_cfg``'s MTP keys onto the model config only when they are
present (an absent ``mtp_num_layers`` keeps the checkpoint's value), so the plugin reads what
is set and otherwise the model's own config, which every worker process can see:

* ``train`` (the policy update): run, unless ``mtp_loss_scaling_factor`` is ``0.0`` (NeMo-RL's
  way of turning the MTP loss off; computing MTP would be wasted). Unconfigured, it abstains
  instead of voting run: Megatron runs MTP by default anyway;
* ``eval`` (``get_logprobs``, the teacher's logits, validation: all ``eval()`` + ``no_grad``):
  skip, unless ``compute_mtp_in_eval=True``;
* ``rollout``: skip.

It abstains for models without MTP and for a config whose ``megatron_cfg.enabled`` is false
(that policy does not run on Megatron). Without :func:`configure` (in a Ray worker, say) it
decides from the model's config alone, and only in a process that has imported ``nemo_rl``, as
NeMo-RL's workers have; unconfigured, in any other process, it abstains, so installing it
changes no other job.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import mtp_hooks
from mtp_hooks import Phase, PolicyError
from mtp_hooks.framework import RoleSettings, as_mapping, framework_imported, read_key

from .masks import mtp_loss_mask

__all__ = [
    "NemoMTPConfig",
    "configure",
    "configure_run",
    "current",
    "mtp_loss_mask",
    "reset",
    "skip_mtp_for_inference",
    "vote",
]

WHERE = "policy.megatron_cfg"


@dataclass(frozen=True)
class NemoMTPConfig:
    """The validated MTP part of one ``megatron_cfg``; ``None`` fields defer to the model."""

    enabled: bool = True
    mtp_num_layers: int | None = None
    mtp_loss_scaling_factor: float | None = None
    compute_mtp_in_eval: bool = False
    configured: bool = True

    def decide(self, model: Any, phase: Any) -> bool | None:
        """The vote for one forward of ``model``; ``None`` abstains."""
        if not self.enabled:
            return None
        config = getattr(model, "config", None)
        layers = self.mtp_num_layers
        if layers is None:
            layers = getattr(config, "mtp_num_layers", None) or 0
        if layers == 0:
            return None
        if phase == Phase.TRAIN:
            scale = self.mtp_loss_scaling_factor
            if scale is None:
                scale = getattr(config, "mtp_loss_scaling_factor", None)
            if scale == 0:
                return False
            return True if self.configured else None  # unconfigured: Megatron runs it anyway
        if phase == Phase.EVAL:
            return self.compute_mtp_in_eval
        if phase == Phase.ROLLOUT:
            return False
        return None


_settings: RoleSettings[NemoMTPConfig] = RoleSettings()


def configure(
    megatron_cfg: Any, *, role: str | None = None, compute_mtp_in_eval: bool = False
) -> NemoMTPConfig:
    """Validate one ``megatron_cfg`` (dict or OmegaConf node) and use its MTP keys.

    Args:
        megatron_cfg: ``policy.megatron_cfg`` (or ``teacher.megatron_cfg``). Only the keys read
            are resolved, so NeMo-RL's custom interpolations elsewhere need no resolver.
        role: Apply to models of this role only (``"teacher"``); ``None``: every other model.
        compute_mtp_in_eval: Run MTP in ``eval`` forwards too (as NeMo-Automodel's option).

    Raises:
        mtp_hooks.PolicyError: A key of the wrong type, a negative ``mtp_num_layers``,
            ``compute_mtp_in_eval`` with zero MTP layers. Nothing changes then.

    Example:
        >>> import mtp_hooks_nemo
        >>> mtp_hooks_nemo.configure({"enabled": True, "mtp_num_layers": 1})
        NemoMTPConfig(enabled=True, mtp_num_layers=1, mtp_loss_scaling_factor=None, \
compute_mtp_in_eval=False, configured=True)
    """
    where = f"{role}.megatron_cfg" if role and role != "policy" else WHERE
    config = _parse(as_mapping(megatron_cfg, where), where, compute_mtp_in_eval)
    _settings.set(config, role)
    return config


def configure_run(master_config: Any, *, compute_mtp_in_eval: bool = False) -> list[str | None]:
    """Configure from a whole NeMo-RL config: ``policy`` for every model, ``teacher`` (or the
    ``teachers`` list of the cross-tokenizer configs) for models with role ``teacher``. A
    section without ``megatron_cfg`` counts as ``enabled: false``. Everything is validated
    before anything is set.

    Returns:
        The roles configured (``None`` stands for every model).
    """
    master = as_mapping(master_config, "NeMo-RL config")
    if master.get("policy") is None:
        raise PolicyError("NeMo-RL config: no 'policy' section to read megatron_cfg from")
    parsed: list[tuple[str | None, NemoMTPConfig]] = [
        (None, _section(master["policy"], "policy", compute_mtp_in_eval))
    ]
    teachers = [("teacher", master["teacher"])] if master.get("teacher") is not None else []
    teachers += [(f"teachers[{i}]", t) for i, t in enumerate(master.get("teachers") or ())]
    found = {_section(node, where, compute_mtp_in_eval) for where, node in teachers}
    if len(found) > 1:
        raise PolicyError(
            "NeMo-RL config: the teachers' megatron_cfg MTP keys differ; give each teacher "
            "model its own role and call mtp_hooks_nemo.configure(cfg, role=...) per teacher"
        )
    parsed += [("teacher", config) for config in found]
    for role, config in parsed:
        _settings.set(config, role)
    return [role for role, _ in parsed]


def _section(node: Any, where: str, compute_mtp_in_eval: bool) -> NemoMTPConfig:
    """One model section; without a ``megatron_cfg`` it does not run on Megatron."""
    section = as_mapping(node, where)
    if section.get("megatron_cfg") is None:
        return NemoMTPConfig(enabled=False)
    where = f"{where}.megatron_cfg"
    return _parse(as_mapping(section["megatron_cfg"], where), where, compute_mtp_in_eval)


def _parse(cfg: Mapping[str, Any], where: str, compute_mtp_in_eval: bool) -> NemoMTPConfig:
    enabled = read_key(cfg, "enabled", bool, where, default=True)
    layers = read_key(cfg, "mtp_num_layers", int, where, default=None)
    if layers is not None and layers < 0:
        raise PolicyError(f"{where}: key 'mtp_num_layers' must be >= 0, got {layers}")
    scale = read_key(cfg, "mtp_loss_scaling_factor", (int, float), where, default=None)
    if scale is not None and not scale >= 0:
        raise PolicyError(f"{where}: key 'mtp_loss_scaling_factor' must be >= 0, got {scale}")
    read_key(cfg, "mtp_use_repeated_layer", bool, where, default=False)
    read_key(cfg, "mtp_detach_heads", bool, where, default=False)
    if not isinstance(compute_mtp_in_eval, bool):
        raise PolicyError(f"compute_mtp_in_eval must be a bool, got {compute_mtp_in_eval!r}")
    if compute_mtp_in_eval and layers == 0:
        raise PolicyError(
            f"compute_mtp_in_eval=True contradicts {where}.mtp_num_layers=0: there is no MTP "
            "to compute; set mtp_num_layers > 0 or drop compute_mtp_in_eval"
        )
    return NemoMTPConfig(
        enabled, layers, None if scale is None else float(scale), compute_mtp_in_eval
    )


def current(role: str | None = None) -> NemoMTPConfig | None:
    """The policy configured for ``role`` (else for every model), or ``None``."""
    return _settings.get(role)


def reset() -> None:
    """Forget the configured policies (``mtp_hooks.testing.reset()`` does it too)."""
    _settings.reset()


# No configure() in this process (a Ray worker): the model's config decides, and the plugin only
# votes where NeMo-RL's semantics call for a skip, so it never contradicts another plugin's run.
WORKER_DEFAULT = NemoMTPConfig(configured=False)


def vote(model: Any, phase: Any) -> bool | None:
    """The plugin's vote: the configured policy for the model's role, else the worker default
    where ``nemo_rl`` is imported, else ``None`` (abstain)."""
    config = current(mtp_hooks.role_of(model))
    if config is None:
        if not framework_imported("nemo_rl"):
            return None
        config = WORKER_DEFAULT
    return config.decide(model, phase)


def skip_mtp_for_inference(model: Any) -> mtp_hooks.AttachHandle:
    """Attach mtp-hooks to a training-side model (what ``MTP_HOOKS_AUTO=1`` does by itself).

    Kept from 0.1. It is *not* a stand-in for Megatron-Bridge's ``disable_mtp_for_inference``,
    whose only call site is Bridge's inference engine: mtp-hooks leaves inference alone.
    """
    return mtp_hooks.attach(model)

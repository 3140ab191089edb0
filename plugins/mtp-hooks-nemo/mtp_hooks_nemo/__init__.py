"""mtp-hooks plugin for Megatron-Bridge and NeMo-RL: MTP in the policy update only.

It reads NeMo-RL's ``policy.megatron_cfg`` MTP keys (``mtp_num_layers``,
``mtp_loss_scaling_factor``, ``mtp_use_repeated_layer``, ``mtp_detach_heads``) and decides:

* ``train`` (the policy update): run when ``mtp_num_layers > 0``;
* ``rollout`` (``get_logprobs`` and generation): skip;
* ``eval``: skip, unless ``compute_mtp_in_eval=True`` (as NeMo-Automodel's option).

It replaces Megatron-Bridge's ``disable_mtp_for_inference``, which sets
``config.mtp_num_layers = None`` on the shared config for good, with a per-call skip.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mtp_hooks
from mtp_hooks import Phase, PolicyError
from mtp_hooks.framework import as_mapping, read_key

__all__ = ["NemoMTPConfig", "configure", "current", "reset", "skip_mtp_for_inference"]

WHERE = "policy.megatron_cfg"


@dataclass(frozen=True)
class NemoMTPConfig:
    """The validated MTP part of ``policy.megatron_cfg``."""

    mtp_num_layers: int
    compute_mtp_in_eval: bool

    def decide(self, phase: Any) -> bool | None:
        """The vote for one forward; abstains when the model has no MTP layers."""
        if self.mtp_num_layers == 0:
            return None
        if phase == Phase.TRAIN:
            return True
        if phase == Phase.EVAL:
            return self.compute_mtp_in_eval
        if phase == Phase.ROLLOUT:
            return False
        return None


_state: dict[str, NemoMTPConfig] = {}


def configure(megatron_cfg: Any, *, compute_mtp_in_eval: bool = False) -> NemoMTPConfig:
    """Validate ``policy.megatron_cfg`` (dict or OmegaConf node) and use its MTP keys.

    Raises:
        mtp_hooks.PolicyError: ``mtp_num_layers`` missing, negative or not an int (``None``
            means 0), another MTP key of the wrong type, or ``compute_mtp_in_eval`` without
            MTP layers. Nothing changes then.

    Example:
        >>> import mtp_hooks_nemo
        >>> mtp_hooks_nemo.configure({"mtp_num_layers": 1})
        NemoMTPConfig(mtp_num_layers=1, compute_mtp_in_eval=False)
    """
    cfg = as_mapping(megatron_cfg, WHERE)
    if "mtp_num_layers" not in cfg:
        raise PolicyError(f"{WHERE}: missing key 'mtp_num_layers' (0 or null disables MTP)")
    layers = read_key(cfg, "mtp_num_layers", int, WHERE, default=0)
    if layers < 0:
        raise PolicyError(f"{WHERE}: key 'mtp_num_layers' must be >= 0, got {layers}")
    read_key(cfg, "mtp_loss_scaling_factor", (int, float), WHERE, default=0.1)
    read_key(cfg, "mtp_use_repeated_layer", bool, WHERE, default=False)
    read_key(cfg, "mtp_detach_heads", bool, WHERE, default=False)
    if not isinstance(compute_mtp_in_eval, bool):
        raise PolicyError(f"compute_mtp_in_eval must be a bool, got {compute_mtp_in_eval!r}")
    if compute_mtp_in_eval and layers == 0:
        raise PolicyError(
            f"compute_mtp_in_eval=True contradicts {WHERE}.mtp_num_layers=0: there is no MTP "
            "to compute; set mtp_num_layers > 0 or drop compute_mtp_in_eval"
        )
    _state["config"] = config = NemoMTPConfig(layers, compute_mtp_in_eval)
    return config


def current() -> NemoMTPConfig | None:
    """The configured policy, or ``None`` before :func:`configure` (the plugin abstains)."""
    return _state.get("config")


def reset() -> None:
    """Forget the configured policy (for tests)."""
    _state.clear()


def skip_mtp_for_inference(model: Any) -> mtp_hooks.AttachHandle:
    """The per-call replacement for Megatron-Bridge's ``disable_mtp_for_inference(model)``.

    Attaches mtp-hooks instead of mutating the shared config: log-prob and eval forwards skip
    MTP, the policy update still trains it, and checkpoints keep the MTP weights.
    """
    return mtp_hooks.attach(model)

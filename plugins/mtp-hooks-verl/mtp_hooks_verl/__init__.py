"""mtp-hooks plugin for veRL: MTP trains in the actor update only, never in log-prob forwards.

veRL's config (``actor_rollout_ref.model.mtp``) has ``enable`` (keep the MTP weights),
``enable_train`` (train MTP during RL) and ``enable_rollout`` (speculative decoding in the
rollout engine). With :func:`configure` this plugin maps it to phases:

* ``train`` (the actor update): run iff ``enable`` and ``enable_train``;
* ``eval`` (actor/ref ``compute_log_prob``, which veRL runs under ``eval()`` + ``no_grad``) and
  ``rollout``: skip;
* role ``ref``: always skip.

In a veRL worker process, where the driver's config object is out of reach, it votes *skip*
for ``eval`` and ``rollout``, and in ``train`` reads veRL's config from the forward call itself:
veRL passes ``labels`` or a ``loss_mask`` to the model exactly when ``enable`` and
``enable_train`` are both on (veRL 0.9.1 passes both; its draft for native ``HybridModel`` MTP
passes the mask alone), so MTP trains in such a forward and is skipped in any other. On a
``GPTModel`` veRL's own ``mtp_patch`` follows the same labels; on a ``HybridModel``, which veRL
0.9.1 does not patch and megatron runs MTP in every training forward, this is what keeps
``enable_train=False`` from training MTP. These worker defaults apply only in a process that
has imported ``verl``, as every veRL worker has; unconfigured, in any other process, the plugin
abstains, so installing it changes no other job. Importing ``verl`` turns on auto-attach (the
``verl.plugins`` entry point, :mod:`mtp_hooks_verl.verl_entry`), so worker models are gated
without code changes.

Speculative decoding stays with the rollout engine: mtp-hooks never touches a forward under
megatron's ``InferenceMode`` or with an inference context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mtp_hooks import ForwardCall, Phase, PolicyError, role_of
from mtp_hooks.framework import RoleSettings, as_mapping, framework_imported, read_key

__all__ = ["VerlMTPConfig", "configure", "current", "reset", "trains_mtp", "vote"]

WHERE = "actor_rollout_ref.model.mtp"


@dataclass(frozen=True)
class VerlMTPConfig:
    """The validated part of veRL's MTP config that decides phases."""

    enable: bool
    enable_train: bool
    enable_rollout: bool
    configured: bool = True

    def decide(self, phase: Any, role: str | None, call: ForwardCall | None = None) -> bool | None:
        """The vote for one forward; ``None`` for phases veRL does not use. ``call``: the
        forward being decided, which the worker default reads in ``train``."""
        if not self.configured:
            if role == "ref" or phase in (Phase.ROLLOUT, Phase.EVAL):
                return False
            if phase == Phase.TRAIN and call is not None:
                return trains_mtp(call)
            return None
        if not self.enable:
            return False
        if role == "ref" or phase in (Phase.ROLLOUT, Phase.EVAL):
            return False
        if phase == Phase.TRAIN:
            return self.enable_train
        return None


def trains_mtp(call: ForwardCall) -> bool:
    """Whether veRL asks this forward to train MTP: it passes ``labels`` or a ``loss_mask``
    to the model only then (``verl/models/mcore/model_forward.py``, ``mtp_enable_train``)."""
    return call.argument("labels") is not None or call.argument("loss_mask") is not None


_settings: RoleSettings[VerlMTPConfig] = RoleSettings()
WORKER_DEFAULT = VerlMTPConfig(True, False, False, configured=False)


def configure(mtp_config: Any) -> VerlMTPConfig:
    """Validate veRL's ``actor_rollout_ref.model.mtp`` node (dict or OmegaConf) and use it.

    Raises:
        mtp_hooks.PolicyError: A missing ``enable``, a non-bool flag, or a contradiction
            (``enable_train`` or ``enable_rollout`` without ``enable``). Nothing changes then.

    Example:
        >>> import mtp_hooks_verl
        >>> mtp_hooks_verl.configure({"enable": True, "enable_train": True})
        VerlMTPConfig(enable=True, enable_train=True, enable_rollout=False, configured=True)
    """
    cfg = as_mapping(mtp_config, WHERE)
    enable = read_key(cfg, "enable", bool, WHERE)
    enable_train = read_key(cfg, "enable_train", bool, WHERE, default=False)
    enable_rollout = read_key(cfg, "enable_rollout", bool, WHERE, default=False)
    read_key(cfg, "mtp_loss_scaling_factor", (int, float), WHERE, default=0.1)
    read_key(cfg, "detach_encoder", bool, WHERE, default=False)
    for key, value in (("enable_train", enable_train), ("enable_rollout", enable_rollout)):
        if value and not enable:
            raise PolicyError(
                f"{WHERE}: {key}=True needs enable=True (MTP weights must be loaded to be used)"
            )
    config = VerlMTPConfig(enable, enable_train, enable_rollout)
    _settings.set(config)
    return config


def current() -> VerlMTPConfig | None:
    """The configured policy, or ``None`` before :func:`configure` (then the worker default
    votes where ``verl`` is imported)."""
    return _settings.get(None)


def reset() -> None:
    """Forget the configured policy (``mtp_hooks.testing.reset()`` does it too)."""
    _settings.reset()


def vote(model: Any, phase: Any, call: ForwardCall | None = None) -> bool | None:
    """The plugin's vote for one forward of ``model``: the configured policy, else the worker
    default where ``verl`` is imported, else ``None`` (abstain)."""
    config = current()
    if config is None:
        if not framework_imported("verl"):
            return None
        config = WORKER_DEFAULT
    return config.decide(phase, role_of(model), call)

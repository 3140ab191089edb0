"""mtp-hooks-nemo against NeMo-RL's own example configs, loaded with their ``defaults:`` chains.

The configs are not shipped with mtp-hooks: point ``NEMO_RL_REPO`` at a checkout of
NVIDIA-NeMo/RL (Apache-2.0) to run these tests; without it they skip.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from omegaconf import DictConfig, ListConfig, OmegaConf

import mtp_hooks_nemo

REPO = os.environ.get("NEMO_RL_REPO")
pytestmark = pytest.mark.skipif(not REPO, reason="set NEMO_RL_REPO to a NeMo-RL checkout")


def load(path: Path) -> DictConfig:
    """NeMo-RL's inheritance: ``defaults`` (one path or a list) merged first, then the file;
    a section marked ``_override_: true`` replaces the inherited one instead of merging."""
    config = OmegaConf.load(path)
    defaults = config.pop("defaults", None)
    if defaults is None:
        return config
    parents = [defaults] if isinstance(defaults, str) else list(defaults)
    merged = OmegaConf.create({})
    for parent in parents:
        merged = merge(merged, load(path.parent / str(parent)))
    return merge(merged, config)


def merge(base: DictConfig, override: DictConfig) -> DictConfig:
    for key in list(override.keys()):
        if OmegaConf.is_missing(override, key):
            continue
        node = override[key]
        if isinstance(node, DictConfig) and node.get("_override_", False):
            node.pop("_override_")
            base.pop(key, None)
    return OmegaConf.merge(base, override)


def megatron_configs() -> list[Path]:
    if not REPO:
        return []
    found = []
    for path in sorted(Path(REPO, "examples", "configs").rglob("*.yaml")):
        config = load(path)
        policy = config.get("policy") if not isinstance(config, ListConfig) else None
        if isinstance(policy, DictConfig) and "megatron_cfg" in policy:
            found.append(path)
    return found


CONFIGS = megatron_configs()


class Checkpoint:
    """A model restored from a checkpoint with one MTP layer, as its config shows it."""

    class config:  # noqa: N801
        mtp_num_layers = 1
        mtp_loss_scaling_factor = 0.1


def intended(megatron_cfg: DictConfig, phase: str) -> bool | None:
    """What NeMo-RL means by the config: MTP layers from the config if given, else the
    checkpoint's; a zero loss weight turns the MTP loss off; log-probs never need MTP."""
    if not megatron_cfg.get("enabled", True):
        return None
    layers = megatron_cfg.get("mtp_num_layers", Checkpoint.config.mtp_num_layers)
    if not layers:
        return None
    if phase == "train":
        return megatron_cfg.get("mtp_loss_scaling_factor", 0.1) != 0
    return False


def test_there_are_many_real_configs():
    assert len(CONFIGS) > 200


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p).split("configs/")[-1])
def test_every_real_config_is_accepted_and_decides_as_nemo_rl_intends(path):
    config = load(path)
    roles = mtp_hooks_nemo.configure_run(config)
    sections = [config.policy] + [t for t in [config.get("teacher")] if t is not None]
    sections += list(config.get("teachers") or ())
    for role, section in zip(roles, sections, strict=False):
        cfg = section.get("megatron_cfg") or OmegaConf.create({"enabled": False})
        decided = mtp_hooks_nemo.current(role)
        for phase in ("train", "eval", "rollout"):
            assert decided.decide(Checkpoint, phase) == intended(cfg, phase), (section, phase)

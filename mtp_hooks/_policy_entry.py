"""One (role, phase) entry of a policy, and its spelling in the compact grammar.

:mod:`mtp_hooks._policy` parses policies into these entries; the sources merge them, the
decision reads them, and ``check-config`` spells them back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PolicyValue = Literal["run", "skip", "auto"]
VALUES: dict[str, PolicyValue] = {"run": "run", "skip": "skip", "auto": "auto"}

Key = tuple[str | None, str]  # (role or None, phase name)


@dataclass(frozen=True)
class PolicyEntry:
    """One (role, phase) setting and where it came from.

    Attributes:
        value: ``"run"``, ``"skip"`` or ``"auto"``.
        source: Where it came from (``mtp_hooks.configure()``, a variable or a file).
        loss_scale: The MTP loss weight for a ``run`` entry (``run:0.3``), else ``None``: the
            model's own ``mtp_loss_scaling_factor`` (or a plugin's ``mtp_loss_scale``) applies.
        metrics: Whether forwards that run MTP with labels record MTP loss and top-1 acceptance
            per depth (``run+metrics``, ``auto+metrics``).
        detach: ``True`` (``run+detach``, TOML ``detach = true``): MTP runs on detached trunk
            outputs, embeddings and output weight, so its loss trains only the MTP weights;
            ``False`` (TOML ``detach = false``): the model's own ``mtp_detach_heads``, whatever
            plugins say; ``None``: not set here, plugins may decide.
        mask: ``"labels"`` (``run+mask:labels``, TOML ``mask = "labels"``): the MTP loss also
            leaves out positions whose label is ``ignore_index``; ``None``: no mask of its own.
        ignore_index: The label that ``mask = "labels"`` leaves out (TOML ``ignore_index``;
            ``None``: -100, as in torch's cross-entropy).
        plugin_masks: ``False`` (TOML ``plugin_masks = false``): plugins' ``mtp_loss_mask``
            answers are not asked for; ``None``: they are.
        objective: What MTP's loss trains toward (``+objective:kl``, TOML ``objective =
            "kl"``): ``"kl"`` the policy's own next-token distribution (self-distillation),
            ``"tv"`` the total variation to it, ``"ce"`` or ``None`` megatron's cross-entropy
            against the labels. ``kl`` and ``tv`` need ``+detach``.
        temperature: The temperature of both distributions under ``kl`` or ``tv`` (TOML
            ``temperature``; ``None``: 1).
    """

    value: PolicyValue
    source: str
    loss_scale: float | None = None
    metrics: bool = False
    detach: bool | None = None
    mask: str | None = None
    ignore_index: int | None = None
    plugin_masks: bool | None = None
    objective: str | None = None
    temperature: float | None = None


def spell(entry: PolicyEntry) -> str:
    """``entry`` in the compact grammar (``run:0.3+metrics+detach``), which parses back to it.

    The weight is written as Python's shortest round-trip ``repr``. The TOML-only choices
    (``detach = false``, the model's own setting; ``ignore_index``; ``plugin_masks = false``;
    ``temperature``) have no compact spelling and are left out.
    """
    weight = "" if entry.loss_scale is None else f":{entry.loss_scale!r}"
    mask = "" if entry.mask is None else f"+mask:{entry.mask}"
    objective = "" if entry.objective is None else f"+objective:{entry.objective}"
    return (
        (f"{entry.value}{weight}" + "+metrics" * entry.metrics + "+detach" * bool(entry.detach))
        + mask
        + objective
    )

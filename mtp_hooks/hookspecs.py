"""The hooks a plugin can implement, and the pluggy markers for the project name ``mtp_hooks``.

A plugin is any module or object with functions decorated by :data:`hookimpl`. Register it with
:func:`mtp_hooks.plugins.register`, or ship it as an entry point in the ``mtp_hooks`` group.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:  # annotations only: torch is optional, and the phases import the registry
    import torch

    from ._forward_call import ForwardCall
    from ._metrics import MTPMetrics
    from ._phases import PhaseLike

__all__ = ["hookspec", "hookimpl", "PROJECT_NAME"]

PROJECT_NAME = "mtp_hooks"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


OBJECTIVES = ("ce", "kl", "tv")
"""What MTP may train toward: the answers of :func:`mtp_objective`, and the names of the
policy's ``+objective:NAME``."""


@hookspec
def should_run_mtp(
    model: torch.nn.Module | None, phase: PhaseLike, call: ForwardCall | None
) -> bool | None:
    """Vote on whether ``model`` runs its MTP block in ``phase``.

    Called at every gated forward call of an attached model (and by :func:`mtp_hooks.decide`),
    unless the policy config already answers for the model's (role, phase). Every plugin votes;
    pluggy's call order never matters. A vote that depends only on the model, the phase and
    state whose changes mtp-hooks is told of can be declared
    :func:`mtp_hooks.framework.cacheable_vote`; a gate then asks once per phase until something
    changes, as long as every plugin that votes is declared so.

    Args:
        model: The Megatron language model about to run (a ``GPTModel`` or ``HybridModel``), or
            ``None`` when a policy is explained without a model (``mtp-hooks explain``).
        phase: A :class:`mtp_hooks.Phase` member or a declared custom phase name (a ``str``).
            ``Phase`` members compare equal to their string values.
        call: The forward call being decided (:class:`mtp_hooks.ForwardCall`: what its caller
            passed), or ``None`` when asked outside a forward (:func:`mtp_hooks.decide`,
            ``explain``). Leave it out of the signature unless the vote needs it (pluggy passes
            an implementation only the arguments it names). A vote that reads it is asked
            again at every forward, even as a ``cacheable_vote``.

    Returns:
        ``True`` to run MTP, ``False`` to skip it, ``None`` to abstain. If the non-``None`` votes
        disagree, :class:`mtp_hooks.PolicyConflictError` is raised; with no votes, MTP runs.

    The answer must be a deterministic function of state that every rank shares (config, phase,
    step counter), never of rank-local state such as timing or randomness: ranks of one model
    replica must agree. Use :func:`mtp_hooks.role_of` to tell teacher and student apart.

    Example:
        .. code-block:: python

            from mtp_hooks import Phase, role_of
            from mtp_hooks.plugins import hookimpl

            class TrainStudentOnly:
                @hookimpl
                def should_run_mtp(self, model, phase):
                    if role_of(model) == "teacher":
                        return False
                    return phase == Phase.TRAIN

            class TrainWhenTheCallerPassesLabels:  # the call carries the caller's intent
                @hookimpl
                def should_run_mtp(self, model, phase, call):
                    if phase != Phase.TRAIN or call is None:
                        return None
                    return call.argument("labels") is not None
    """


@hookspec
def declare_phases() -> Iterable[str]:  # type: ignore[empty-body]
    """Declare custom phase names (beyond ``train``, ``eval`` and ``rollout``) that a plugin uses.

    Declared phases are accepted by :func:`mtp_hooks.phase`, :func:`mtp_hooks.decide` and the
    policy config, exactly like phases declared with :func:`mtp_hooks.declare_phase`.

    Returns:
        An iterable of identifiers.

    Example:
        .. code-block:: python

            from mtp_hooks.plugins import hookimpl

            @hookimpl
            def declare_phases():
                return ["distill", "ref_logprob"]
    """


@hookspec
def mtp_loss_scale(model: torch.nn.Module | None, phase: PhaseLike) -> float | None:
    """Give the MTP loss weight (``mtp_loss_scaling_factor``) for a forward that runs MTP.

    Consulted when MTP runs and the policy config gives no weight for the model's (role,
    phase) (``train=run:0.3`` does). Agreeing weights apply to that one forward, through the
    per-call config copy the model reads the weight from; different weights raise
    :class:`mtp_hooks.PolicyConflictError`; ``None`` abstains, and with no weight at all the
    model's own ``mtp_loss_scaling_factor`` applies. The backward of that forward uses the
    weight it was given. A weight of ``0`` still computes MTP: vote ``False`` in
    ``should_run_mtp`` to save the compute.

    Args:
        model: As for :func:`should_run_mtp`.
        phase: As for :func:`should_run_mtp`.

    Returns:
        A finite float ``>= 0``, or ``None``.

    Example:
        .. code-block:: python

            from mtp_hooks.plugins import hookimpl
            from mtp_hooks.framework import loss_scale_schedule

            class DeepSeekV3Schedule:
                def __init__(self, trainer):
                    self.trainer = trainer

                @hookimpl
                def mtp_loss_scale(self, model, phase):
                    return loss_scale_schedule({0: 0.3, 10_000: 0.1}, self.trainer.step)
    """


@hookspec
def mtp_detach_heads(model: torch.nn.Module | None, phase: PhaseLike) -> bool | None:
    """Say whether a forward that runs MTP trains it on detached inputs.

    ``True`` works like megatron's ``mtp_detach_heads`` for that one forward: MTP runs on
    detached trunk hidden states, embeddings and output weight, so the MTP loss trains only the
    MTP weights and adds nothing to the gradients of the trunk, the embedding or the output
    layer. Consulted when MTP runs and the policy config does not say (``train=run+detach``
    or TOML ``detach = false`` does). It combines like :func:`mtp_loss_scale`: agreeing
    answers apply, different ones raise :class:`mtp_hooks.PolicyConflictError`, ``None``
    abstains, and ``False`` (or no answer) leaves the model's own setting. A megatron-core
    without the ``mtp_detach_heads`` field (before 0.19) refuses a ``True``.

    Args:
        model: As for :func:`should_run_mtp`.
        phase: As for :func:`should_run_mtp`.

    Returns:
        ``True``, ``False`` or ``None``.

    Example:
        .. code-block:: python

            from mtp_hooks import Phase
            from mtp_hooks.plugins import hookimpl

            class IsolatedDrafter:
                @hookimpl
                def mtp_detach_heads(self, model, phase):
                    return True if phase == Phase.TRAIN else None
    """


@hookspec
def mtp_objective(model: torch.nn.Module | None, phase: PhaseLike) -> str | None:
    """Say what a forward that runs MTP trains it toward: ``"ce"``, ``"kl"`` or ``"tv"``.

    ``"ce"`` is megatron's cross-entropy against the labels; ``"kl"`` and ``"tv"`` train each
    depth toward the policy's own detached next-token distribution (self-distillation, or
    total variation) at temperature 1. Consulted when MTP runs and the policy config names no
    objective (``train=run+detach+objective:kl`` does). It combines like
    :func:`mtp_detach_heads`: agreeing answers apply, different ones raise
    :class:`mtp_hooks.PolicyConflictError`, ``None`` abstains. ``"kl"`` and ``"tv"`` need the
    forward detached (``+detach``, or :func:`mtp_detach_heads`); without, the answer is a
    :class:`mtp_hooks.PolicyError` before the forward changes anything.

    Args:
        model: As for :func:`should_run_mtp`.
        phase: As for :func:`should_run_mtp`.

    Returns:
        ``"ce"``, ``"kl"``, ``"tv"`` or ``None``.

    Example:
        .. code-block:: python

            from mtp_hooks import Phase
            from mtp_hooks.plugins import hookimpl

            class SampledRollouts:
                @hookimpl
                def mtp_detach_heads(self, model, phase):
                    return True if phase == Phase.TRAIN else None

                @hookimpl
                def mtp_objective(self, model, phase):
                    return "kl" if phase == Phase.TRAIN else None
    """


@hookspec
def mtp_loss_mask(
    model: torch.nn.Module,
    phase: PhaseLike,
    loss_mask: torch.Tensor | None,
    labels: torch.Tensor | None,
    input_ids: torch.Tensor | None,
) -> torch.Tensor | None:
    """Give the MTP loss of this forward a mask of its own: which positions MTP trains on.

    Called at each forward of an attached model that runs MTP and has labels to train it on
    (given, or derived by megatron from ``input_ids``), before the forward changes anything.
    The answers of all plugins, of enclosing :func:`mtp_hooks.mtp_loss_mask` blocks and the
    caller's own ``loss_mask`` are multiplied elementwise (an intersection of 0/1 masks), and
    the product is what megatron's MTP loss weighs its positions by. Only the MTP loss, its
    gradients and ``+metrics`` see it; the language-model loss and logits do not change.

    Args:
        model: The Megatron language model about to run.
        phase: As for :func:`should_run_mtp`.
        loss_mask: The caller's ``loss_mask`` for this forward, or ``None``.
        labels: The forward's labels, or ``None`` where megatron derives them from
            ``input_ids`` (then the mask has the shape of ``input_ids``).
        input_ids: The forward's token ids.

    Returns:
        A tensor of weights ``>= 0`` (bool, integer or floating) on the labels' device and of
        their shape, or ``None`` to abstain. Anything else raises
        :class:`mtp_hooks.PolicyError` naming the plugin, before the forward runs.

    Example:
        .. code-block:: python

            from mtp_hooks.plugins import hookimpl

            class ResponseOnly:
                @hookimpl
                def mtp_loss_mask(self, model, phase, loss_mask, labels, input_ids):
                    return None if labels is None else labels != -100
    """


@hookspec
def mtp_metrics(model: torch.nn.Module, phase: PhaseLike, metrics: MTPMetrics) -> None:
    """Receive the MTP loss and top-1 acceptance of one forward that recorded them.

    Called after each forward of an attached model whose policy entry for its (role, phase)
    asks for metrics (``eval=run+metrics``), once that forward has returned. Use it to log the
    values (TensorBoard, W&B); :meth:`mtp_hooks.AttachHandle.metrics` keeps the running means.
    Reading the floats makes the host wait for the device once per recorded forward, so this
    hook is only called when some plugin implements it. The values are this rank's: reduce
    ``tokens``-weighted across data-parallel ranks where you need a global figure.

    Args:
        model: As for :func:`should_run_mtp`.
        phase: As for :func:`should_run_mtp`.
        metrics: This forward's :class:`mtp_hooks.MTPMetrics` (``forwards == 1``).

    Example:
        .. code-block:: python

            from mtp_hooks.plugins import hookimpl

            class LogMTP:
                def __init__(self, writer, trainer):
                    self.writer, self.trainer = writer, trainer

                @hookimpl
                def mtp_metrics(self, model, phase, metrics):
                    for depth, (loss, acc) in enumerate(
                        zip(metrics.loss, metrics.acceptance), start=1
                    ):
                        self.writer.add_scalar(f"{phase}/mtp_{depth}_loss", loss, self.trainer.step)
                        self.writer.add_scalar(
                            f"{phase}/mtp_{depth}_acceptance", acc, self.trainer.step
                        )
    """

"""Megatron modes and calls a gate cannot handle safely, each refused with its cause and fix.

Every refusal raises :class:`mtp_hooks.UnsupportedModelError` before anything is changed.
"""

from __future__ import annotations

from typing import Any, Protocol

from .. import _options, _roles, _sources
from .._errors import PolicyConflictError, UnsupportedModelError
from .._option_base import Layout
from . import _capabilities, _cuda_graphs

UNGUARDED = (
    "mtp_hooks: this megatron-core divides each MTP depth's loss by its number of masked-in "
    "positions without guarding zero (process_mtp_loss, which does, came in megatron-core "
    "0.18), so a mask that leaves a microbatch no position (an all-prompt batch, or only "
    "negative advantages) would turn the loss and every gradient into NaN. Upgrade "
    "megatron-core (0.17 and later need Python 3.12), or drop the MTP loss mask (+mask, the "
    "mtp_loss_mask plugin or block)."
)
"""Why a megatron-core without ``process_mtp_loss`` takes no MTP loss mask (0.16, 0.17)."""


class ExecutionMode(Protocol):
    """What a gate knows, from attach, of how its model runs
    (:class:`._call_planning.CallPlanner` has these)."""

    local_graphs: bool
    full_graphs: bool
    ep_overlap: bool
    detach_refusal: str | None
    standalone: bool
    tied_hazard: bool


def check_policy(gate: ExecutionMode, model: Any, role: str | None) -> None:
    """Refuse a policy this model's execution mode cannot follow: CUDA graphs, ``+detach``
    where it cannot work, ``+metrics`` in a standalone-MTP layout, masks where megatron would
    divide by zero, a skip on a tied MTP stage. Called at attach and whenever the policy
    changes (through :func:`._phase_plan.check_policy`, which adds the combined 1F1B
    schedule), so the news comes before the first training step."""
    if gate.tied_hazard:
        check_tied_stage_policy(model, role)
    if gate.local_graphs:
        _cuda_graphs.check_policy(model, role)
    if gate.full_graphs:
        _cuda_graphs.check_full_iteration_policy(model, role)
    if gate.detach_refusal is not None:
        check_detach_policy(role, gate.detach_refusal)
    else:
        check_detach_clipping(model, role)
    check_layout_policy(gate, role)
    if not _capabilities.guards_empty_mtp_masks():
        check_mask_policy(role)


def check_tied_stage_policy(model: Any, role: str | None) -> None:
    """Refuse now a policy that skips MTP in any phase on an MTP pipeline stage with tied
    embeddings and no native flag, where the skip itself would be refused: at the first
    evaluation of a ``train=run,eval=skip`` job, not after its hours of training."""
    from .. import _decision, _phase_catalogue

    skipped = [
        name
        for name in _phase_catalogue.known_phases()
        if not _decision.decide_normalized(model, _phase_catalogue.normalize(name), role)[0].run
    ]
    if skipped:
        refuse_tied_stage_skip(", ".join(f"{name}=skip" for name in skipped))


def refuse_tied_stage_skip(what: str = "a skip") -> None:
    """A skip on an MTP pipeline stage with tied embeddings and no native flag."""
    raise UnsupportedModelError(
        option="skip",
        message=f"mtp_hooks: cannot skip MTP ({what}) on this pipeline stage: it has MTP, no "
        "pre_process and share_embeddings_and_output_weights=True, and this megatron-core has no "
        "native compute_mtp_loss flag. Turning mtp_process off would switch the output "
        "layer to an unsynced weight and silently change the loss. Use a policy that "
        "runs MTP here, set share_embeddings_and_output_weights=False, or upgrade to a "
        "megatron-core whose HybridModel.forward accepts compute_mtp_loss.",
    )


def check_callers_own_skip(model: Any, plan: Any) -> None:
    """A call to which its caller passed ``compute_mtp_loss=False`` while ``plan`` (a
    ``PhasePlan`` that runs MTP) asks for what only a run gives."""
    asked = plan.asked(needing_a_run=True)
    if asked:
        raise PolicyConflictError(
            phase=str(plan.phase),
            role=_roles.role_of(model),
            option=" and ".join(asked),
            message=f"mtp_hooks: this {type(model).__name__} forward in phase '{plan.phase}' was "
            f"called with compute_mtp_loss=False, which turns MTP off for the call, but the "
            f"decision for '{plan.phase}' asks to run it with {' and '.join(asked)}. A caller's "
            f"own compute_mtp_loss=False always wins. Let mtp-hooks decide instead (drop the "
            f"keyword, and set {plan.phase}=skip where MTP should not run), or drop "
            f"{' and '.join(asked)} for '{plan.phase}'; mtp_hooks.explain(model, "
            f"'{plan.phase}') shows who asked for it.",
        )


def refuse_ep_overlap(what: str) -> None:
    """A training decision (``what``: ``"skip"``, or the options a run asks for) that the
    combined 1F1B schedule cannot follow (:func:`._phase_plan.check_policy` says why)."""
    raise UnsupportedModelError(
        phase="train",
        option=what,
        message=f"mtp_hooks: the policy's training decision for a model with "
        f"overlap_moe_expert_parallel_comm=True is {what}, which cannot be applied: megatron's "
        "combined 1F1B schedule builds every training microbatch with build_schedule_plan, "
        "which runs no forward hook and includes the MTP layers whenever the model has them, "
        "so training runs MTP plainly, as megatron decides (evaluation and other forward-only "
        "passes follow the policy: train=run, eval=skip works). Set a plain train=run for "
        "this model, or overlap_moe_expert_parallel_comm=False to gate training too.",
    )


def detach_refusal(config: Any, graphs: str | None) -> str | None:
    """Why ``+detach`` cannot work on a model with ``config`` (``None``: it can)."""
    if not _capabilities.has_detach_field(config):
        return (
            "this megatron-core's TransformerConfig has no mtp_detach_heads field (it came in "
            "megatron-core 0.19), and that field is how each forward is told to detach MTP's "
            "inputs; its optimizer also clips one global gradient norm, with no group for the "
            "MTP weights, so even a detached MTP would change the trunk's clip coefficient. "
            "Upgrade megatron-core (0.17 and later need Python 3.12), or drop '+detach' "
            "(mtp_hooks.megatron.freeze_trunk trains the MTP weights alone)"
        )
    if graphs is not None:
        return (
            f"this model uses CUDA graphs (cuda_graph_impl={graphs!r}), and a per-forward "
            "detach has not been verified against captured graphs. Build the model with "
            "mtp_detach_heads=True to detach in every forward, or set cuda_graph_impl='none'"
        )
    return None


def check_detach_policy(role: str | None, refusal: str) -> None:
    """Refuse now a policy config that detaches MTP in some phase of a model that cannot.
    Reads the config only: a plugin's answer is checked when it is given, before the forward."""
    for name in _sources.configured_with(role, "detach"):
        refuse_detach(name, "the policy config", refusal)


def refuse_detach(phase: str, by: str | None, refusal: str) -> None:
    """``+detach`` for ``phase`` (asked by ``by``) on a model where ``refusal`` says why not."""
    raise UnsupportedModelError(
        f"mtp_hooks: {by} asks to detach MTP in {phase}, but {refusal}.",
        phase=phase,
        option="+detach",
    )


def clipping_refusal(model: Any) -> str | None:
    """Why ``+detach`` would not leave the trunk's update that of a skip (``None``: it would):
    MTP weights outside megatron's MTP gradient-norm group, so a global clip counts them."""
    group = _capabilities.mtp_grad_norm_group()
    if group is None:  # no groups: the optimizer cannot be told, and +detach is refused anyway
        return None
    untagged = _capabilities.untagged_mtp_parameters(model, group)
    if not untagged:
        return None
    return (
        f"its MTP weights ({untagged[0]} and {len(untagged) - 1} more) are not in megatron's "
        f"{group!r} gradient-norm group, so a global gradient clip (megatron's optimizer clips "
        "at clip_grad=1.0 unless told otherwise) would count MTP's gradients in the trunk's "
        "clip coefficient and change the policy's update. Call "
        "mtp_hooks.megatron.clip_mtp_apart(model) on the bare model before wrapping it in DDP, "
        "building the optimizer and attaching it, or, where a framework builds the model "
        "(Megatron-LM's pretrain() or train_rl.py), call "
        "mtp_hooks.auto_attach(clip_mtp_apart=True) before it does (a model built with "
        "mtp_detach_heads=True is tagged already)"
    )


def check_detach_clipping(model: Any, role: str | None) -> None:
    """Refuse now a policy config that detaches MTP in some phase of a model whose MTP weights
    a global clip would mix with the trunk's."""
    names = _sources.configured_with(role, "detach")
    if names and (refusal := clipping_refusal(model)) is not None:
        refuse_detach(names[0], "the policy config", refusal)


def check_mask_policy(role: str | None) -> None:
    """Refuse now a policy config that masks the MTP loss (``+mask:labels``) on a megatron-core
    whose MTP loss divides by an unguarded count (:data:`UNGUARDED`)."""
    for name in _sources.configured_with(role, "mask"):
        raise UnsupportedModelError(
            f"{UNGUARDED} (the policy config masks it in {name})", phase=name, option="+mask:labels"
        )


def layout(gate: ExecutionMode, phase: str) -> Layout:
    """How ``gate``'s model runs the forwards of ``phase``, as the options read it."""
    replayed = gate.full_graphs and phase in _cuda_graphs.GRAPHED_PHASES
    return Layout(replayed=replayed, standalone=gate.standalone)


def check_layout_policy(gate: ExecutionMode, role: str | None) -> None:
    """Refuse now a policy config entry that asks an option for what the model's layout keeps
    it from (:meth:`mtp_hooks.plugins.Option.refusal`), before the first step."""
    for phase, entry in _sources.configured(role):
        check_layout(gate, phase, entry.options, "the policy config")


def check_layout(gate: ExecutionMode, phase: str, options: Any, by: str | None = None) -> None:
    """Refuse a call of ``phase`` under ``options`` (a config entry's, or a decision's) that
    asks an option for what the model's layout keeps it from; ``by``: who asked, where the
    options do not say (a config entry's)."""
    where = layout(gate, phase)
    if where.plain:
        return
    refusals = _options.each("refusal", lambda option: option.refusal(options, where))
    for option, why in zip(_options.options(), refusals, strict=True):
        if why is None:
            continue
        if by is None:  # a decision's: the config or the plugins that set the option
            setter = options.by(option.name)
            by = "the policy config" if setter == "config" else f"plugin(s) {setter}"
        raise UnsupportedModelError(
            f"mtp_hooks: {by} asks '+{option.name}' in {phase}, but {why}.",
            phase=phase,
            option=f"+{option.name}",
        )

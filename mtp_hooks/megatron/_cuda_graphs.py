"""What megatron's CUDA graphs let a gate decide, checked before the first training step.

megatron has three kinds of training graphs, and the gate acts on ``GPTModel``/``HybridModel``,
whose forward megatron never graphs on its own:

* **local** (``cuda_graph_impl="local"``, or the older ``enable_cuda_graph=True``): each
  graphed layer (with ``cuda_graph_modules`` ``attn`` or ``mlp`` too) records its graphs in the
  training forwards that run before megatron creates them, and from then on every call of the
  layer, evaluation included, replays one of them (megatron asserts "no matching cudagraph
  runners" otherwise). MTP layers that training skipped have no graph, so where megatron graphs
  the MTP layers, MTP can run later only if it ran in training.
* **Transformer Engine** (``cuda_graph_impl="transformer_engine"``): the graphs are captured
  before the first training step from sample inputs, layer by layer, and replayed only while
  the layer is in training mode; evaluation runs eagerly. Every policy works.
* **full iteration** (``cuda_graph_impl="full_iteration"``): megatron captures the whole
  forward-backward of a training iteration, and of an ``evaluate()`` iteration, each after
  ``cuda_graph_warmup_steps`` eager ones, and replays them without running any Python, hooks
  included. The gate decides in the eager iterations and during capture, so each graph holds
  the decision of its phase. Whenever anything a decision depends on changes
  (:func:`mtp_hooks._runtime.advance`), :func:`recapture` drops megatron's captured graphs
  through megatron's own ``reset_cuda_graph``, so the next iterations run eagerly again, where
  the gate decides anew, and megatron captures again. What replays cannot follow is refused at
  attach and when the policy changes: ``+metrics`` (recorded in Python after each forward),
  votes of plugins asked at every forward, and loss weights from plugins.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from .. import _decision, _phase_catalogue, _phases, _sources
from .._errors import UnsupportedModelError
from .._plugin_registry import registry as _registry
from . import _capabilities

logger = logging.getLogger("mtp_hooks")
GRAPHED_PHASES = (_phases.Phase.TRAIN, _phases.Phase.EVAL)
"""The phases of megatron's captured iterations: training, and ``evaluate()``."""


def implementation(config: Any) -> str | None:
    """``"local"``, ``"transformer_engine"``, ``"full_iteration"``, or ``None`` when ``config``
    graphs nothing for training."""
    impl = getattr(config, "cuda_graph_impl", "none")
    scope = getattr(config, "cuda_graph_scope", None)  # releases before cuda_graph_modules
    scopes = scope if isinstance(scope, (list, tuple)) else [scope]
    if impl == "full_iteration" or any(str(s).endswith("full_iteration") for s in scopes):
        return "full_iteration"
    if impl == "local" or getattr(config, "enable_cuda_graph", False):
        return "local"
    return "transformer_engine" if impl == "transformer_engine" else None


def live_implementation(model: Any) -> str | None:
    """:func:`implementation` of ``model``'s config, but ``None`` for local graphs that no
    module holds a graph manager for. Megatron-LM's RL loop (``train_rl.py`` without
    ``--rl-training-cuda-graphs``) turns local graphs off for its log-prob and training passes
    with ``toggle_cuda_graphs(model, "none")``, which deletes every layer's
    ``cudagraph_manager``, and then puts ``cuda_graph_impl="local"`` back on the config: those
    passes run eagerly, and every policy holds there. A model built with local graphs keeps a
    manager on each graphed layer until then."""
    impl = implementation(model.config)
    if impl == "local" and not any(hasattr(m, "cudagraph_manager") for m in model.modules()):
        return None
    return impl


def mtp_layers_graphed(model: Any) -> bool:
    """Whether megatron gave any of ``model``'s MTP modules a local graph manager (it does for
    the layers inside the MTP block unless ``cuda_graph_modules`` leaves them out)."""
    return any(hasattr(m, "cudagraph_manager") for m in model.mtp.modules())


def check_policy(model: Any, role: str | None) -> None:
    """Refuse now a policy that local graphs cannot follow: MTP skipped in training and run in
    another phase. Decides every phase for ``model``'s role; changes nothing.

    Raises:
        UnsupportedModelError: Names the phases that would run MTP, and the fix.
    """

    def runs(phase: _phases.Phase | str) -> bool:
        return _decision.decide_normalized(model, phase, role)[0].run

    if runs(_phases.Phase.TRAIN):
        return
    running = [
        name
        for name in _phase_catalogue.known_phases()
        if name != "train" and runs(_phase_catalogue.normalize(name))
    ]
    if running:
        _refuse(", ".join(f"{name}=run" for name in running), "this policy")


def check_replayable(model: Any) -> None:
    """Refuse a forward that would run MTP when megatron has created its local graphs without
    graphing the MTP layers (a plugin skipped MTP in training, then asked for it)."""
    graphed = [m for m in model.mtp.modules() if hasattr(m, "cudagraph_manager")]
    if not graphed or not _graphs_created():
        return
    if not any(getattr(m.cudagraph_manager, "cudagraph_runners", None) for m in graphed):
        _refuse("a decision to run MTP now", "the decisions so far")


def _graphs_created() -> bool:
    """Whether megatron has turned its recorded local graphs into CUDA graphs."""
    try:
        from megatron.core.transformer import cuda_graphs
    except ImportError:
        return False
    record = getattr(cuda_graphs, "_CudagraphGlobalRecord", None)
    return bool(getattr(record, "cudagraph_created", False))


def _refuse(what: str, whose: str) -> None:
    raise UnsupportedModelError(
        f"mtp_hooks: {whose} skips MTP in training but has {what}, on a model with local CUDA "
        "graphs (cuda_graph_impl='local'). megatron graphs each layer from the training "
        "forwards and replays those graphs in every later forward, evaluation included; MTP "
        "layers skipped in training have no graph, and megatron would fail with 'no matching "
        "cudagraph runners'. Run MTP in training (e.g. train=run, eval=skip works), skip it in "
        "the other phases too, use cuda_graph_impl='transformer_engine', or set "
        "cuda_graph_impl='none'."
    )


# -- full-iteration graphs ---------------------------------------------------------------------
def refuse_unfollowable_full_graphs() -> None:
    """At attach: full-iteration graphs on a megatron-core that cannot drop a captured graph."""
    if _capabilities.full_graph_wrapper() is None:
        raise UnsupportedModelError(
            "mtp_hooks.attach: this model uses full-iteration CUDA graphs, which replay the "
            "whole training and evaluation iterations without running any forward hook, and "
            "this megatron-core's FullCudaGraphWrapper has no reset_cuda_graph() (it came in "
            "megatron-core 0.18), so a policy change could never reach the captured graphs. "
            "Upgrade megatron-core, use per-layer graphs (cuda_graph_impl='local' or "
            "'transformer_engine'), or set cuda_graph_impl='none'."
        )


def check_full_iteration_policy(model: Any, role: str | None) -> None:
    """Refuse what full-iteration replays cannot follow in training and evaluation: a vote of a
    plugin asked at every forward, a loss weight from a plugin (a ``cacheable_vote`` changes
    only through :func:`mtp_hooks.framework.votes_changed`, which reaches :func:`recapture`).
    What an option cannot do in a replay its own :meth:`~mtp_hooks.plugins.Option.refusal`
    says (:func:`._refusals.check_layout`).

    Raises:
        UnsupportedModelError: Names the phase, what cannot be followed and the fix.
    """
    if _sources.polls_file():
        raise UnsupportedModelError(
            "mtp_hooks: this model uses full-iteration CUDA graphs, which replay megatron's "
            "training and evaluate() iterations without running any forward hook, but the "
            f"policy file MTP_HOOKS_CONFIG={os.environ.get('MTP_HOOKS_CONFIG')!r} is "
            "watched, and is re-read only at forwards: its edits would never reach the "
            "captured graphs. Set MTP_HOOKS_CONFIG_POLL=never and call mtp_hooks.reload() "
            "from the training loop after editing the file (it drops the captured graphs), or "
            "set cuda_graph_impl to 'local', 'transformer_engine' or 'none'."
        )
    cached_votes = _registry().votes_cacheable()
    for phase in GRAPHED_PHASES:
        decision = _decision.decide_normalized(model, phase, role)[0]
        voters = [name for name, vote in decision.votes.items() if vote is not None]
        weight_by = decision.options.by("loss_scale")
        if voters and not cached_votes:
            what = f"plugin(s) {', '.join(voters)} voting in {phase}"
            why = "asks its plugins at every forward, and replays ask no one"
            fix = f"set {phase} in the policy config, or declare the votes cacheable_vote"
        elif weight_by not in (None, "config"):
            what = f"the MTP loss weight of plugin(s) {weight_by} in {phase}"
            why = "asks for a plugin's weight at every forward (it may follow the step)"
            fix = f"give {phase} its weight in the policy config (run:W)"
        else:
            continue
        raise UnsupportedModelError(
            f"mtp_hooks: this model uses full-iteration CUDA graphs, which replay megatron's "
            f"training and evaluate() iterations without running any forward hook, but the "
            f"policy has {what}, which {why}. To fix it, {fix}, or set cuda_graph_impl to "
            "'local', 'transformer_engine' or 'none'."
        )


def capturing() -> bool:
    """Whether this thread's current CUDA stream is capturing a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def recapture() -> None:
    """Drop megatron's captured full-iteration graphs, so that the next iterations run eagerly
    (where gates decide anew) and megatron captures them again. Called whenever anything a
    decision depends on changes while a model with full-iteration graphs is attached.

    Raises:
        UnsupportedModelError: The change came while a graph is being captured.
    """
    wrapper = _capabilities.full_graph_wrapper()
    if wrapper is None:
        return
    captured = [stage for stage, graph in wrapper.cuda_graph.items() if graph is not None]
    if not captured:
        return
    if capturing():
        raise UnsupportedModelError(
            "mtp_hooks: the policy changed while megatron was capturing a full-iteration CUDA "
            f"graph, and the captured {', '.join(captured)} graphs cannot be dropped during a "
            "capture. Change the policy between training steps."
        )
    # reset_cuda_graph reads only FullCudaGraphWrapper's class-level state, and __init__ needs
    # a CUDA stream: an instance without __init__ calls megatron's own method.
    unbound = object.__new__(wrapper)
    for stage in captured:
        unbound.reset_cuda_graph(stage)
    logger.info(
        "mtp_hooks: the policy changed; megatron's captured full-iteration CUDA graphs (%s) are "
        "dropped and will be captured again after cuda_graph_warmup_steps eager iterations",
        ", ".join(captured),
    )

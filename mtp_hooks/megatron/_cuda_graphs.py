"""What megatron's CUDA graphs let a gate decide, checked before the first training step.

megatron graphs layers (``TransformerLayer``, ``MambaLayer``, and the transformer layer inside
each MTP layer), never ``GPTModel``/``HybridModel``, whose forward stays eager and is where
the gate acts. A skipped MTP block therefore just leaves its layers' graphs unused. What can
fail is the other direction, and only with ``cuda_graph_impl="local"``:

* **local** (``cuda_graph_impl="local"``, or the older ``enable_cuda_graph=True``): each
  layer's graphs are recorded in the training forwards that run before megatron creates them,
  and from then on every call of a graphed layer, evaluation included, replays one of them
  (megatron asserts "no matching cudagraph runners" otherwise). MTP layers that training
  skipped have no graph, so MTP can run later only if it ran in training.
* **Transformer Engine** (``cuda_graph_impl="transformer_engine"``): the graphs are captured
  before the first training step from sample inputs, layer by layer, and replayed only while
  the layer is in training mode; evaluation runs eagerly. Every policy works.

So with local graphs a policy that skips MTP in training and runs it in another phase is
refused at the first forward, before any step. A decision that only a plugin makes later is
checked against megatron's own record of what was graphed, at the forward that would fail.
"""

from __future__ import annotations

from typing import Any

from .. import _decision, _phases
from .._errors import UnsupportedModelError


def implementation(config: Any) -> str | None:
    """``"local"``, ``"transformer_engine"``, or ``None`` when ``config`` graphs no layer."""
    impl = getattr(config, "cuda_graph_impl", "none")
    if impl == "local" or getattr(config, "enable_cuda_graph", False):
        return "local"
    return "transformer_engine" if impl == "transformer_engine" else None


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
        name for name in _phases.known_phases() if name != "train" and runs(_phases.normalize(name))
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

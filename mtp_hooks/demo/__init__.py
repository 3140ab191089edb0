"""``mtp-hooks demo``: policies applied to tiny real megatron-core models on a CPU.

This subpackage also holds the scaffolding the demo, the tests and the benchmarks share, kept
out of the core: :mod:`mtp_hooks.demo.tiny_models` builds tiny real ``GPTModel`` and
``HybridModel`` instances on one gloo rank.

Builds a ``GPTModel`` and a ``HybridModel`` with one MTP layer each, and a Nemotron-3-shaped
``HybridModel`` (MoE layers, two attention + MoE MTP depths), attaches mtp-hooks, and runs a train
step, an eval forward and a rollout (log-prob) forward under a policy. Every "ran" and
"logged" cell is observed (a forward hook on ``model.mtp``, megatron's MTP loss tracker), not
inferred from the decision; the metrics cell shows what ``+metrics`` recorded
(``AttachHandle.metrics()``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .. import _decision, _phase_catalogue, _sources
from ..hookspecs import PROJECT_NAME

__all__ = ["run_demo"]

REPEATS = 3  # calls per row: 'yes' and 'no' hold on every one, else the row says 'mixed'


@dataclass
class Row:
    model: str
    phase: str
    decision: str
    decided_by: str
    mtp_ran: str
    loss_recorded: str
    metrics: str
    failure: str = ""  # what megatron raised, printed under the table: stderr is hidden then


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Hide megatron's import-time warnings and log lines (deprecations, Apex, TE)."""
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        previous = logging.root.manager.disable
        logging.disable(logging.WARNING)
        try:
            yield
        finally:
            logging.disable(previous)


def _megatron_version() -> str:
    # megatron.core.__version__ may carry the git hash of the current directory; ask pip's record
    import importlib.metadata

    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _progress(message: str) -> None:
    print(f"[mtp-hooks demo] {message}", file=sys.stderr, flush=True)


def _measure(model: Any, label: str, handle: Any, phase: str, step: Callable[[], None]) -> Row:
    from . import tiny_models

    depths = model.config.mtp_num_layers or 1
    device = next(model.parameters()).device  # megatron adds each MTP loss into the tracker
    mtp_forwards = tiny_models.MTPForwards(model)
    decision = _decision.decide(model, phase)
    ran, recorded = [], []
    try:
        for _ in range(REPEATS):
            tiny_models.reset_mtp_loss_tracker(num_layers=depths, device=device)
            before = mtp_forwards.n
            step()
            ran.append(mtp_forwards.n > before)
            recorded.append(tiny_models.recorded_mtp_loss() > 0)
    except Exception as exc:  # megatron itself failed (e.g. 0.16 MTP needs labels): show it
        return Row(
            model=label,
            phase=phase,
            decision="run" if decision.run else "skip",
            decided_by=decision.decided_by,
            mtp_ran=f"megatron raised {type(exc).__name__}",
            loss_recorded="-",
            metrics="-",
            failure=_failure(exc),
        )
    finally:
        mtp_forwards.remove()
    recorded_metrics = handle.metrics(reset=True).get(phase)
    return Row(
        model=label,
        phase=phase,
        decision="run" if decision.run else "skip",
        decided_by=decision.decided_by,
        mtp_ran="yes" if all(ran) else "no" if not any(ran) else "mixed",
        loss_recorded="yes" if all(recorded) else "no" if not any(recorded) else "mixed",
        metrics="-"
        if recorded_metrics is None
        else f"loss {recorded_metrics.loss[0]:.2f}, accepted {recorded_metrics.acceptance[0]:.1%}",
    )


def _rows_for(model: Any, label: str, handle: Any, batch: tuple[Any, Any, Any]) -> list[Row]:
    import torch

    ids, pos, labels = batch
    rows = []

    def train_step() -> None:
        model.train()
        model.zero_grad(set_to_none=True)
        loss = model(ids, pos, None, labels=labels)
        loss.mean().backward()

    def eval_forward() -> None:
        model.eval()
        with torch.no_grad():
            model(ids, pos, None, labels=labels)

    def rollout_forward() -> None:
        model.eval()
        with torch.no_grad(), _phase_catalogue.phase("rollout"):
            model(ids, pos, None)  # an RL log-prob forward: no labels

    for phase, step in (
        ("train", train_step),
        ("eval", eval_forward),
        ("rollout", rollout_forward),
    ):
        rows.append(_measure(model, label, handle, phase, step))
    return rows


def _failure(exc: BaseException) -> str:
    """``exc`` in one line with the frame that raised it, for the lines under the table."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _failures(rows: list[Row]) -> str:
    """One line per row whose step raised: the model, the phase and what was raised."""
    return "\n".join(f"{r.model}, {r.phase}: {r.failure}" for r in rows if r.failure)


def _table(rows: list[Row]) -> str:
    header = (
        "model",
        "phase",
        "decision",
        "decided by",
        "MTP ran",
        "MTP loss logged by megatron",
        "MTP metrics (+metrics)",
    )
    cells = [header] + [
        (
            r.model,
            r.phase,
            r.decision,
            r.decided_by,
            r.mtp_ran,
            r.loss_recorded,
            r.metrics,
        )
        for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


DEFAULT_POLICY = "train=run+metrics,eval=skip,rollout=skip"


MODELS = {  # --models name: (the table's label, what the progress line says is built)
    "gpt": ("GPTModel", "a tiny GPTModel with one MTP layer"),
    "hybrid": ("HybridModel", "a tiny attention + MLP HybridModel with one MTP layer"),
    "nemotron": (
        "Nemotron-3 hybrid",
        "a tiny Nemotron-3-shaped HybridModel: Mamba-2, attention and MoE layers, two "
        "attention + MoE MTP depths, on the GPU",
    ),
}
NEEDS_GPU = (
    "a Nemotron-3 hybrid needs a GPU: megatron's MoE router moves its weights to CUDA in every "
    "forward and its Mamba-2 layer runs Triton kernels. Run `mtp-hooks demo --models nemotron` "
    "on a machine with CUDA and mamba-ssm (docs/integrations.md, Nemotron 3)"
)


def _build(name: str, spec: Any) -> Any:
    """The demo's model ``name``; raises ImportError, naming what is missing, where it cannot
    be built here."""
    import torch

    from . import nemotron_models, tiny_models

    if name == "gpt":
        return tiny_models.build_gpt(spec, attention="sdpa")
    if name == "hybrid":
        return tiny_models.build_hybrid(spec, attention="sdpa")
    if not torch.cuda.is_available():
        raise ImportError(NEEDS_GPU)
    pattern = nemotron_models.NEMOTRON_PATTERN
    if not nemotron_models.can_build_mamba():
        _progress("mamba-ssm is not importable: the Nemotron-3 hybrid is built without Mamba-2")
        pattern = pattern.replace("M", "*")
    # no linear biases, as Nemotron 3 has none: megatron 0.19's expert MLP adds an expert bias
    # into a view its backward owns, which autograd refuses in a training step
    spec = dataclasses.replace(spec, bias=False)
    return nemotron_models.build_nemotron(spec, pattern=pattern).cuda()


def run_demo(policy: str = DEFAULT_POLICY, models: str = "gpt,hybrid") -> int:
    """Run the demo and print its table. Returns the process exit status."""
    _sources.configure(policy)  # validated before anything is built
    wanted = [m.strip() for m in models.split(",") if m.strip()]
    unknown = set(wanted) - set(MODELS)
    if unknown:
        from .._errors import PolicyError

        raise PolicyError(
            f"--models: unknown model {sorted(unknown)}; choose from {', '.join(MODELS)}"
        )
    _progress("importing torch and megatron-core ...")
    with _quiet():
        import megatron.core.models.gpt  # noqa: F401  (import-time warnings stay quiet)
        import torch

        from .. import megatron as adapters
        from . import tiny_models

    version = _megatron_version()
    torch.manual_seed(0)
    spec = tiny_models.TinySpec(hidden_size=64, num_layers=2, vocab_size=256, seq_length=64)
    ids = torch.randint(0, spec.vocab_size, (4, spec.seq_length))
    pos = torch.arange(spec.seq_length).unsqueeze(0).expand(4, -1)
    batch = (ids, pos, torch.roll(ids, -1, dims=1))
    rows: list[Row] = []
    with _quiet():
        tiny_models.init_single_process(port=tiny_models.free_port())
    for name in wanted:
        label, what = MODELS[name]
        _progress(f"building {what} (megatron-core {version}) ...")
        try:
            with _quiet():
                model = _build(name, spec)
        except ImportError as exc:
            _progress(f"skipping {name}: {exc}")
            continue
        handle = adapters.attach(model)
        _progress(f"running train / eval / rollout on the {label} ...")
        device = next(model.parameters()).device
        ids, pos, labels = (t.to(device) for t in batch)
        with _quiet():
            rows += _rows_for(model, label, handle, (ids, pos, labels))
        handle.remove()
    if not rows:  # every model asked for was skipped: no table to print
        print(
            f"mtp-hooks demo: none of the models asked for ({', '.join(wanted)}) could be built "
            "here, so nothing ran; the lines above say why",
            file=sys.stderr,
        )
        return 1
    where = "CUDA" if "nemotron" in wanted and torch.cuda.is_available() else "CPU"
    print(
        f"\nmtp-hooks demo: policy {policy!r}, megatron-core {version}, {PROJECT_NAME} on {where}\n"
    )
    print(_table(rows))
    if _failures(rows):
        print(f"\nWhat megatron raised:\n{_failures(rows)}")
    print(
        "\nMTP ran: observed with a forward hook on model.mtp. MTP loss logged by megatron: its "
        "MTPLossLoggingHelper tracker,\nwhich megatron fills only for training-mode forwards. "
        "MTP metrics: what a '+metrics' policy entry recorded\n(depth 1's mean MTP loss and "
        "top-1 acceptance; an untrained model accepts about 1 draft in vocab_size).\n"
        "No timings: on models this small they measure Python, not MTP. What a skip saves is "
        "measured on a GPU\n(docs/benchmarks.md), and the hooks' CPU cost by "
        "benchmarks/cpu_overhead.py."
    )
    return 0

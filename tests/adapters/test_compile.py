"""An attached model under ``torch.compile``, on a CPU, in the two forms a model is compiled.

* **The forward** (``model.forward = torch.compile(model.forward)``): torch runs the module's
  hooks, the gate's included, eagerly around the compiled forward, so dynamo never meets them:
  it compiles and breaks exactly as for the model without hooks, and attaching after the first
  compiled call is seen.
* **The module** (``torch.compile(model)``): dynamo traces a module's hooks with its forward.
  The gate's hooks hand themselves to ``torch.compiler.disable``d twins when traced, so the
  decision runs eagerly at the model's call boundary, at the cost of a graph break there on
  each side; the forward's graphs are those of the model without hooks, op for op.

``torch._dynamo.explain`` and dynamo's counters say what it compiled and where it broke a
graph; the ``eager`` backend keeps the tests fast and compiles the same graphs dynamo would
hand to inductor.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import pytest
import torch

import mtp_hooks
from mtp_hooks.demo import tiny_models

from model_fixtures import Wrapper

dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.utils import counters  # noqa: E402

# What dynamo says when it meets a hook it must run outside its graphs: the breaks the gate's
# hooks cost, at the model's call boundary, where no graph of the forward is cut.
AT_THE_HOOKS = "Skip calling `torch.compiler.disable()`d function"


FORMS = ("forward", "module")


@contextlib.contextmanager
def compiled_in(form: str, model: torch.nn.Module):
    """``model`` compiled in ``form``: the callable to call it through. The forward form sets
    the compiled forward on the instance (where torch's ``_call_impl`` looks it up) and takes
    it off after."""
    if form == "module":
        yield torch.compile(model, backend="eager")
        return
    model.forward = torch.compile(model.forward, backend="eager")
    try:
        yield model
    finally:
        del model.forward


def forward(model, batch, phase: str):
    """One forward of ``model`` in ``phase``: a training step with its backward, an
    evaluation with labels, or a rollout's log-prob pass."""
    if phase == "train":
        model.train()
        return model(*batch.args(), labels=batch.labels).sum().backward()
    model.eval()
    with torch.no_grad():
        if phase == "eval":
            return model(*batch.args(), labels=batch.labels)
        with mtp_hooks.phase("rollout"):
            return model(*batch.args())


class Explanation(NamedTuple):
    """What dynamo made of one forward: the number of operations in each graph, each graph
    break's reason and the line of user code it broke at (``dynamo.explain``), and every break
    dynamo counted on the way by first line, the hooks' included (its counters)."""

    graphs: list[int]
    breaks: list[tuple[str, str]]
    reasons: collections.Counter


def explained(model, batch, phase: str) -> Explanation:
    """What dynamo makes of one forward of ``model`` in ``phase`` (training's without its
    backward), compiled as a module."""
    dynamo.reset()
    counters.clear()
    model.train(phase == "train")
    labels = None if phase == "rollout" else batch.labels
    with contextlib.ExitStack() as blocks:
        if phase != "train":
            blocks.enter_context(torch.no_grad())
        if phase == "rollout":
            blocks.enter_context(mtp_hooks.phase("rollout"))
        explanation = dynamo.explain(model)(*batch.args(), labels=labels)
    breaks = [
        (r.reason.splitlines()[0], f"{r.user_stack[-1].filename}:{r.user_stack[-1].lineno}")
        for r in explanation.break_reasons
    ]
    return Explanation([len(ops) for ops in explanation.ops_per_graph], breaks, breaks_by_reason())


def break_reasons(model, batch, phase: str, form: str = "module") -> collections.Counter:
    """The reasons dynamo gives for the graph breaks of one compiled forward of ``model`` in
    ``phase``, counted by first line, wherever they fall (at the hooks too)."""
    return compiled_forward(model, batch, phase, form).breaks


class Compilation(NamedTuple):
    """What dynamo did for one compiled forward: its graph breaks by reason (first line), and
    how many graphs and operations it captured."""

    breaks: collections.Counter
    graphs: int
    operations: int


def compiled_forward(model, batch, phase: str, form: str) -> Compilation:
    """Compile ``model`` in ``form``, run one forward in ``phase`` through it, and say what
    dynamo did."""
    dynamo.reset()
    counters.clear()
    with compiled_in(form, model) as compiled:
        forward(compiled, batch, phase)
    stats = counters["stats"]
    return Compilation(breaks_by_reason(), stats["unique_graphs"], stats["calls_captured"])


def breaks_by_reason() -> collections.Counter:
    """The graph breaks dynamo counted since its counters were cleared, by first line."""
    reasons: collections.Counter = collections.Counter()
    for reason, n in counters["graph_break"].items():
        reasons[reason.splitlines()[0]] += n
    return reasons


def hook_free_reference(build, model, batch, phase: str, decision: str) -> torch.nn.Module:
    """What an attached ``model`` must compile to under ``decision``: the same model before
    attach for a run, the trunk built without MTP for a skip (the gates make the MTP model
    compute exactly that trunk). It has run once eagerly, so that megatron's first-call state
    (its loss tracker's keys) is settled before anything is compiled."""
    reference = model if decision == "run" else trunk(build)
    forward(reference, batch, phase)
    return reference


def trunk(build) -> torch.nn.Module:
    """A model of the current kind built without MTP, with the weights ``build()`` gives."""
    return build(spec=tiny_models.TinySpec(seq_length=16, vocab_size=128, mtp_num_layers=None))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    yield
    dynamo.reset()


@pytest.mark.parametrize(
    ("phase", "decision"),
    [("train", "run"), ("train", "skip"), ("eval", "skip"), ("rollout", "skip"), ("eval", "run")],
)
def test_an_attached_model_compiles_to_the_graphs_of_the_same_model_without_hooks(
    build, batch, count_mtp, phase, decision
):
    model = build()
    counter = count_mtp(model)
    reference = explained(hook_free_reference(build, model, batch, phase, decision), batch, phase)
    before = counter.n
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure(f"{phase}={decision}")
    got = explained(model, batch, phase)
    assert (got.graphs, got.breaks) == (reference.graphs, reference.breaks)  # op for op
    assert not any("mtp_hooks" in where for _, where in got.breaks)
    # beyond megatron's own, dynamo breaks only where it meets the hooks (before and after the
    # forward's graphs, which are unchanged)
    extra = got.reasons - reference.reasons
    assert set(extra) <= {AT_THE_HOOKS}, extra
    assert counter.n - before == (1 if decision == "run" else 0)
    assert handle.stats() == {phase: {decision: 1}}
    assert model.mtp_process is True and handle.gates[0].records == []


@pytest.mark.parametrize(
    ("phase", "decision"),
    [("train", "run"), ("train", "skip"), ("eval", "skip"), ("rollout", "skip")],
)
def test_a_compiled_forward_breaks_and_captures_exactly_as_the_model_without_hooks(
    build, batch, count_mtp, phase, decision
):
    model = build()
    counter = count_mtp(model)
    reference = hook_free_reference(build, model, batch, phase, decision)
    expected = compiled_forward(reference, batch, phase, "forward")
    before = counter.n
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure(f"{phase}={decision}")
    got = compiled_forward(model, batch, phase, "forward")
    # not one break more: the same reasons as often, the same graphs, the same operations
    assert got == expected
    assert got.graphs > 0 and AT_THE_HOOKS not in got.breaks
    assert counter.n - before == (1 if decision == "run" else 0)
    assert handle.stats() == {phase: {decision: 1}}
    assert model.mtp_process is True and handle.gates[0].records == []


def test_attaching_after_the_forward_was_compiled_and_ran_is_seen_at_the_next_call(
    build, batch, count_mtp
):
    model = build()
    counter = count_mtp(model)
    with compiled_in("forward", model):
        forward(model, batch, "train")  # compiled and run as megatron runs it: MTP on
        assert counter.n == 1
        handle = mtp_hooks.attach(model)
        mtp_hooks.configure("train=skip")
        forward(model, batch, "train")
        assert counter.n == 1 and handle.stats() == {"train": {"skip": 1}}
        handle.remove()
        forward(model, batch, "train")
        assert counter.n == 2


def test_inside_a_wrapper_the_gated_models_compiled_forward_breaks_nowhere_for_the_library(
    build, batch, count_mtp
):
    # a wrapper's own forward, compiled, would trace into the model's call and its hooks: the
    # forward to compile is that of the model the gate hooks, which the handle names
    model = build()
    counter = count_mtp(model)
    reference = hook_free_reference(build, model, batch, "train", "skip")
    expected = compiled_forward(reference, batch, "train", "forward")
    wrapped = Wrapper(model)
    handle = mtp_hooks.attach(wrapped)
    mtp_hooks.configure("train=skip")
    assert handle.gated == [model]
    dynamo.reset()
    counters.clear()
    with compiled_in("forward", model):
        forward(wrapped, batch, "train")
    assert breaks_by_reason() == expected.breaks
    assert counter.n == 0 and handle.stats() == {"train": {"skip": 1}}


@pytest.mark.parametrize("form", FORMS)
def test_a_changed_decision_compiles_once_per_decision_and_then_reuses_its_graphs(
    build, batch, count_mtp, form
):
    model = build()
    counter = count_mtp(model)
    handle = mtp_hooks.attach(model)
    dynamo.reset()
    counters.clear()
    seen = []
    with compiled_in(form, model) as compiled:
        for _round in range(3):
            for decision in ("run", "skip"):
                mtp_hooks.configure(f"train={decision}")
                before = counter.n
                forward(compiled, batch, "train")
                assert (counter.n > before) is (decision == "run")
            seen.append(counters["stats"]["unique_graphs"])
    # round two recompiles megatron's save_metrics_to_tracker once (its tracker has keys after
    # the first MTP forward, as in a model without hooks); from then on nothing compiles
    assert seen[0] > 0 and seen[1] == seen[2]
    assert handle.stats() == {"train": {"run": 3, "skip": 3}}


class Compiled(NamedTuple):
    """An attached model, compiled after attach, that has skipped MTP in one training step."""

    model: torch.nn.Module
    shared: object  # the model's own config
    counter: tiny_models.MTPForwards
    handle: mtp_hooks.AttachHandle
    compiled: torch.nn.Module


@pytest.fixture(params=FORMS)
def compiled_skipping(request, build, batch, count_mtp) -> Iterator[Compiled]:
    model = build()
    shared, counter = model.config, count_mtp(model)
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip")
    with compiled_in(request.param, model) as compiled:
        forward(compiled, batch, "train")
        yield Compiled(model, shared, counter, handle, compiled)


def test_a_compiled_forward_that_raises_restores_the_gates(compiled_skipping, batch):
    model, shared, counter, handle, compiled = compiled_skipping
    bad = batch.input_ids.clone()
    bad[0, 0] = 10**6  # the embedding's lookup fails when the graph runs, not while traced
    model.train()
    with pytest.raises((IndexError, RuntimeError)):
        compiled(bad, batch.position_ids, batch.attention_mask, labels=batch.labels)
    assert model.mtp_process is True and model.config is shared
    assert handle.gates[0].records == []
    mtp_hooks.configure("train=run")
    forward(compiled, batch, "train")
    assert counter.n == 1 and handle.stats() == {"train": {"skip": 2, "run": 1}}


def test_ctrl_c_in_a_compiled_forward_is_repaired_by_the_next_forward(compiled_skipping, batch):
    model, shared, counter, handle, compiled = compiled_skipping

    def interrupt(*_):
        raise KeyboardInterrupt

    hook = model.decoder.register_forward_hook(interrupt)
    model.train()
    with pytest.raises(KeyboardInterrupt):
        compiled(*batch.args(), labels=batch.labels)
    hook.remove()
    mtp_hooks.configure("train=run")
    seen = []
    model.decoder.register_forward_pre_hook(
        lambda *_: seen.append((model.mtp_process, model.config is shared))
    )
    forward(compiled, batch, "train")
    assert seen[-1] == (True, True) and counter.n == 1
    assert model.mtp_process is True and model.config is shared
    assert handle.gates[0].records == []


def test_a_model_already_compiled_is_refused_naming_the_order_that_works(build):
    model = build()
    with pytest.raises(mtp_hooks.UnsupportedModelError, match="attach the model itself") as info:
        mtp_hooks.attach(torch.compile(model, backend="eager"))
    assert "model.forward = torch.compile(model.forward)" in str(info.value)
    assert not model._forward_pre_hooks


@pytest.mark.parametrize("form", FORMS)
def test_remove_after_compiled_forwards_gives_megatrons_own_mtp_back(build, batch, count_mtp, form):
    model = build()
    counter = count_mtp(model)
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip")
    with compiled_in(form, model) as compiled:
        forward(compiled, batch, "train")
        assert counter.n == 0 and handle.stats() == {"train": {"skip": 1}}
        handle.remove()
        forward(compiled, batch, "train")  # the policy still says skip; nothing consults it now
        assert counter.n == 1
    assert not model._forward_pre_hooks and not model._forward_hooks


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("decision", ["run", "skip"])
def test_a_model_auto_attached_and_compiled_before_its_first_forward_breaks_only_at_the_hook(
    build, batch, count_mtp, decision, form
):
    # the reference: a model of the same build's first forward, compiled, with no hook at all
    reasons = break_reasons(build(), batch, "train", form)
    mtp_hooks.auto_attach()
    try:
        model = build()  # watched: its first forward attaches it, inside the compiled call
    finally:
        mtp_hooks.auto_attach(False)
    counter = count_mtp(model)
    mtp_hooks.configure(f"train={decision}")
    extra = break_reasons(model, batch, "train", form) - reasons
    # a compiled forward: no break more; a compiled module: at the hook, where dynamo meets it
    assert set(extra) <= ({AT_THE_HOOKS} if form == "module" else set()), extra
    assert counter.n == (1 if decision == "run" else 0)
    handle = mtp_hooks.attach(model)  # the handle the first forward made
    assert handle.stats() == {"train": {decision: 1}}
    assert model.mtp_process is True and handle.gates[0].records == []

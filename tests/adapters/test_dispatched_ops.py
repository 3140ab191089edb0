"""What the hooks cost the tensor work of a forward: nothing, counted operation by operation.

The GPU benchmarks time a skip against the model built without MTP, and hooks that say *run*
against no hooks; their ratios carry the machine's jitter. These tests count instead: with
torch's profiler, the ATen operations a forward dispatches, each with its input shapes. A
skipped forward of the MTP model dispatches exactly what the same architecture built without
MTP dispatches, and a forward through hooks that say *run* exactly what the model without hooks
dispatches: the hooks' own work is Python, and adds no tensor operation.

Each count follows one warm-up call of the same kind (first calls allocate lazily).
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

import mtp_hooks  # noqa: E402
from mtp_hooks.demo import tiny_models  # noqa: E402

from dispatch_counts import dispatched, phase_steps  # noqa: E402
from model_fixtures import SEQ, VOCAB  # noqa: E402


def steps(model, batch):
    """A train step, a log-prob forward and an eval forward of ``model`` on ``batch``."""
    return phase_steps(model, batch.args(), batch.labels)


def without_mtp(kind: str, build):
    """The same architecture built without MTP, with the same seed."""
    spec = dataclasses.replace(
        tiny_models.TinySpec(seq_length=SEQ, vocab_size=VOCAB), mtp_num_layers=None
    )
    return build(spec=spec, **({"pattern": "*-*-"} if kind == "hybrid" else {}))


def test_a_skipped_forward_dispatches_exactly_the_operations_of_the_model_built_without_mtp(
    kind, build, batch, count_mtp
):
    model, plain = build(), without_mtp(kind, build)
    assert plain.mtp_process is False or getattr(plain, "mtp", None) is None
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip,rollout=skip,eval=skip")
    ran = count_mtp(model)
    for name, step in steps(model, batch).items():
        skipped, built = dispatched(step), dispatched(steps(plain, batch)[name])
        assert sum(skipped.values()) > 100, name  # a real forward was counted
        assert skipped == built, (name, skipped - built, built - skipped)
    assert ran.n == 0


def test_hooks_that_say_run_dispatch_exactly_the_operations_of_the_model_without_hooks(
    build, batch, count_mtp
):
    model = build()
    ran = count_mtp(model)
    # forwards with labels: megatron-core 0.16 cannot run MTP without them, hooks or not
    labelled = {k: v for k, v in steps(model, batch).items() if k != "rollout"}
    bare = {name: dispatched(step) for name, step in labelled.items()}
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("train=run,eval=run")
    for name, step in labelled.items():
        hooked = dispatched(step)
        assert hooked == bare[name], (name, hooked - bare[name], bare[name] - hooked)
    assert handle.stats()["train"]["run"] == 2
    assert ran.n == 8  # MTP ran in every counted and warm-up forward, with and without hooks


def test_the_count_tells_a_forward_that_ran_mtp_from_one_that_skipped_it(build, batch):
    model = build()
    mtp_hooks.attach(model)
    counted = {}
    for policy in ("run", "skip"):
        mtp_hooks.configure(f"eval={policy}")
        counted[policy] = dispatched(steps(model, batch)["eval"])
    extra = counted["run"] - counted["skip"]
    assert sum(extra.values()) > 10  # MTP's layer, projection and loss

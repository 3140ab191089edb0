"""``+detach`` under megatron's own optimizer with gradient clipping, on a GPU.

megatron's optimizer computes gradient norms with CUDA allocations, so this runs only where CUDA
is. A GPTModel with MTP is wrapped in megatron's ``DistributedDataParallel`` and trained for a
few optimizer steps through ``get_forward_backward_func()`` with a clip small enough that every
step clips. With the MTP weights clipped apart (``mtp_hooks.megatron.clip_mtp_apart``), a detached
training step leaves the trunk bit for bit where a skipped one does, and so does megatron's own
``mtp_detach_heads=True``. The control shows the clip is what matters: the same built flag with
its tags removed moves the trunk elsewhere.
"""

from __future__ import annotations

import pytest
import torch

import mtp_hooks

from megatron_training import tiny_gpt, train_steps, wrap
from model_fixtures import has_detach_field

pytestmark = [
    pytest.mark.skipif(not has_detach_field(), reason="+detach needs mtp_detach_heads (0.19)"),
    pytest.mark.usefixtures("cuda_mtp_tracker"),
]

STEPS, MICROBATCHES = 4, 2
CLIP = 0.05  # below every step's gradient norm here, so every step clips


def train(policy: str, optimizer_kind: str, *, tag: bool, built_detach: bool = False) -> dict:
    """Train STEPS steps under ``policy``; return the trunk and MTP weights after, and the
    trunk's gradient norm of each step (before clipping)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    distributed = optimizer_kind == "distributed"
    model = tiny_gpt(**({"mtp_detach_heads": True} if built_detach else {}))
    if tag:
        mtp_hooks.megatron.clip_mtp_apart(model)
    else:
        for param in model.mtp.parameters():  # megatron's own tags of a built flag, removed
            if hasattr(param, "grad_norm_group"):
                del param.grad_norm_group
    wrapped = wrap(
        model,
        DistributedDataParallelConfig(use_distributed_optimizer=distributed),
        OptimizerConfig(
            optimizer="adam",
            lr=1e-3,
            weight_decay=0.0,
            clip_grad=CLIP,
            use_distributed_optimizer=distributed,
        ),
    )
    handle = mtp_hooks.attach(wrapped.ddp)
    mtp_hooks.configure(policy)
    steps = train_steps(wrapped, STEPS, MICROBATCHES)
    handle.remove()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {
        "trunk": {n: w for n, w in weights.items() if not n.startswith("mtp.")},
        "mtp": {n: w for n, w in weights.items() if n.startswith("mtp.")},
        "norms": [step.grad_norm for step in steps],
    }


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("optimizer_kind", ["local", "distributed"])
def test_under_a_clipping_megatron_optimizer_a_detached_step_moves_the_trunk_as_a_skip_does(
    optimizer_kind,
):
    skipped = train("train=skip", optimizer_kind, tag=True)
    detached = train("train=run+detach", optimizer_kind, tag=True)
    undetached = train("train=run", optimizer_kind, tag=True)
    print(f"{optimizer_kind}: trunk norms skip={skipped['norms']} detach={detached['norms']}")
    assert all(n > CLIP for n in skipped["norms"])  # every step clipped the trunk
    assert same(skipped["trunk"], detached["trunk"])
    assert skipped["norms"] == detached["norms"]
    assert not same(skipped["mtp"], detached["mtp"])  # and MTP trained
    assert not same(skipped["trunk"], undetached["trunk"])  # undetached, MTP reaches the trunk


@pytest.mark.parametrize("optimizer_kind", ["local", "distributed"])
def test_megatrons_built_flag_moves_the_trunk_as_a_skip_does_and_only_with_its_tags(
    optimizer_kind,
):
    skipped = train("train=skip", optimizer_kind, tag=True)
    built = train("train=run", optimizer_kind, tag=True, built_detach=True)
    untagged = train("train=run", optimizer_kind, tag=False, built_detach=True)
    assert same(skipped["trunk"], built["trunk"])
    # the control: the same detached gradients under one global clip move the trunk elsewhere
    assert not same(skipped["trunk"], untagged["trunk"])
    assert untagged["norms"][0] > skipped["norms"][0]


def test_a_skip_on_an_untagged_model_and_a_tagged_one_agree(capsys):
    # What the tag changes for a skip: MTP's zero gradients leave or join the trunk's norm.
    tagged = train("train=skip", "local", tag=True)
    untagged = train("train=skip", "local", tag=False)
    with capsys.disabled():
        identical = same(tagged["trunk"], untagged["trunk"])
        print(f"skip, tagged against untagged: trunks bit-identical: {identical}")
    assert tagged["norms"] == pytest.approx(untagged["norms"], rel=1e-6)

"""Megatron DDP on a GPU: overlapped grad reduce, distributed optimizer, overlapped param gather.

Skipped without CUDA. On the one-H200 machine (see docs/distributed.md) it trains a GPTModel
with MTP wrapped in the real ``megatron.core.distributed.DistributedDataParallel`` for three
optimizer steps of four microbatches through ``get_forward_backward_func()``, with MTP always
run, always skipped, skipped only in the last microbatch, and frozen with ``freeze_mtp``. The
unremedied hand-made skip is shown to fail with megatron's bucket assertion.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import mtp_hooks

from megatron_training import tiny_gpt, train_steps, wrap

pytestmark = [
    pytest.mark.usefixtures("cuda_mtp_tracker"),
]

STEPS, MICROBATCHES = 3, 4


class SkipLastMicrobatch:
    """A deterministic policy: MTP runs in microbatches 0..2 and is skipped in microbatch 3."""

    def __init__(self) -> None:
        self.calls = 0

    @mtp_hooks.plugins.hookimpl
    def should_run_mtp(self, model, phase):
        run = self.calls % MICROBATCHES != MICROBATCHES - 1
        self.calls += 1
        return run


def naive_skip_last_microbatch(model, from_step: int):
    """What frameworks do by hand today: flip the gates, with no zero gradients."""
    calls = {"n": 0}
    saved = []

    def pre(module, args):
        n = calls["n"]
        if n // MICROBATCHES >= from_step and n % MICROBATCHES == MICROBATCHES - 1:
            saved.append((module.mtp_process, module.config))
            module.mtp_process = False
            module.config = copy.copy(module.config)
            module.config.mtp_num_layers = None
        calls["n"] += 1

    def post(module, args, output):
        if saved:
            module.mtp_process, module.config = saved.pop()

    model.register_forward_pre_hook(pre)
    model.register_forward_hook(post, always_call=True)


def train(mode: str, naive_from_step: int = 0, attach_inner: bool = False):
    """Train STEPS optimizer steps; return (losses, MTP weights before, MTP weights after).

    ``mode="naive"`` skips MTP by hand in the last microbatch of every step from
    ``naive_from_step`` on. ``attach_inner`` attaches mtp-hooks to the bare model instead of
    the DDP wrapper, so it cannot reach DDP's param-gather buckets.
    """
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    model = tiny_gpt()
    if mode == "frozen":
        mtp_hooks.megatron.freeze_mtp(model)
    if mode == "naive":
        naive_skip_last_microbatch(model, naive_from_step)
    mtp_before = {
        n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("mtp.")
    }
    wrapped = wrap(
        model,
        DistributedDataParallelConfig(
            overlap_grad_reduce=True,
            use_distributed_optimizer=True,
            overlap_param_gather=True,
            bucket_size=40_000,  # several buckets, so MTP parameters get buckets of their own
        ),
        OptimizerConfig(
            optimizer="adam", lr=1e-3, weight_decay=0.1, use_distributed_optimizer=True
        ),
    )
    if mode != "naive":
        mtp_hooks.attach(model if attach_inner else wrapped.ddp)
    if mode in ("run",):
        mtp_hooks.configure("train=run")
    elif mode in ("skip", "frozen"):
        mtp_hooks.configure("train=skip")
    elif mode == "skip_last":
        mtp_hooks.plugins.register(SkipLastMicrobatch(), name="skip-last-microbatch")
    losses = [step.loss for step in train_steps(wrapped, STEPS, MICROBATCHES)]
    mtp_after = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("mtp.")}
    mtp_hooks.remove(wrapped.ddp)
    return losses, mtp_before, mtp_after


def test_an_unremedied_skip_in_a_later_step_fails_with_the_bucket_assertion():
    # Step 1 runs MTP everywhere, so megatron learns that MTP parameters report grads; a later
    # step that skips MTP in the synchronising microbatch never issues their bucket.
    with pytest.raises(AssertionError, match="Communication call has not been issued"):
        train("naive", naive_from_step=1)


def test_an_unremedied_skip_from_the_first_step_fails_the_bucket_group_check():
    # Skipping from step 1 on teaches megatron a bucket group without the MTP grads; the next
    # step's completeness check (param_and_grad_buffer.py, register_grad_ready) fails.
    with pytest.raises(AssertionError) as info:
        train("naive", naive_from_step=0)
    assert info.traceback[-1].path.name == "param_and_grad_buffer.py"


@pytest.mark.parametrize("mode", ["run", "skip", "skip_last", "frozen"])
def test_training_under_megatron_ddp_gives_finite_losses(mode):
    losses, _, _ = train(mode)
    print(f"mode={mode} losses={losses}")
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)


def test_frozen_mtp_weights_stay_bit_identical_across_steps():
    _, before, after = train("frozen")
    assert before and all(torch.equal(before[n], after[n]) for n in before)


def test_skipped_mtp_weights_still_move_under_adam_weight_decay():
    _, before, after = train("skip")
    assert any(not torch.equal(before[n], after[n]) for n in before)

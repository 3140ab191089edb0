"""Megatron's own training loop, as the GPU tests run it: a small ``GPTModel`` with MTP, wrapped
in megatron's ``DistributedDataParallel`` with megatron's optimizer, and stepped through
``get_forward_backward_func()`` on the same token ids every time.

The tests differ in what they do to the model before it is wrapped (tags, a frozen MTP, a
hand-made skip), in the DDP and optimizer settings, and in what they attach; the loop is this
one.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from mtp_hooks.demo import tiny_models

SEQ, MBS, VOCAB = 128, 2, 1024


def tiny_gpt(**extra: Any) -> torch.nn.Module:
    """The tests' GPTModel with MTP on the GPU, seeded; ``extra``: config fields to set."""
    spec = tiny_models.TinySpec(
        hidden_size=256,
        num_layers=2,
        num_attention_heads=8,
        vocab_size=VOCAB,
        seq_length=SEQ,
        extra=extra,
    )
    torch.manual_seed(0)
    return tiny_models.build_gpt(spec, attention="local").cuda()


class Wrapped(NamedTuple):
    """A model inside megatron's DDP, with megatron's optimizer over it."""

    ddp: torch.nn.Module
    optimizer: Any


class Step(NamedTuple):
    """One optimizer step: the mean LM loss of its microbatches and the gradient norm that
    megatron's optimizer reported (before clipping; ``None`` without clipping)."""

    loss: float
    grad_norm: float | None


def wrap(model: torch.nn.Module, ddp_config: Any, optimizer_config: Any) -> Wrapped:
    """Wrap ``model`` as megatron's training does: DDP, its optimizer, and the config hooks
    that ``get_forward_backward_func()`` calls (``no_sync``, ``finalize_model_grads``)."""
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer

    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    optimizer = get_megatron_optimizer(optimizer_config, [ddp])
    model.config.no_sync_func = ddp.no_sync
    model.config.finalize_model_grads_func = finalize_model_grads
    return Wrapped(ddp, optimizer)


def train_steps(wrapped: Wrapped, steps: int, microbatches: int) -> list[Step]:
    """``steps`` optimizer steps of ``microbatches`` microbatches each, on token ids drawn from
    one seed, so that every run of a test sees the same data."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, VOCAB, (steps * microbatches, MBS, SEQ), device="cuda", generator=g)
    pos = torch.arange(SEQ, device="cuda").unsqueeze(0).expand(MBS, -1)

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch, pos, None, labels=torch.roll(batch, -1, dims=1))

        def loss_func(output_tensor):
            loss = output_tensor.float().mean()
            return loss, {"lm loss": loss.detach()}

        return output, loss_func

    fwd_bwd = get_forward_backward_func()
    done = []
    for step in range(steps):
        wrapped.ddp.zero_grad_buffer()
        wrapped.optimizer.zero_grad()
        out = fwd_bwd(
            forward_step_func=forward_step,
            data_iterator=iter(ids[step * microbatches : (step + 1) * microbatches]),
            model=[wrapped.ddp],
            num_microbatches=microbatches,
            seq_length=SEQ,
            micro_batch_size=MBS,
            forward_only=False,
        )
        ok, norm, _ = wrapped.optimizer.step()
        assert ok
        loss = float(torch.stack([o["lm loss"] for o in out]).mean())
        done.append(Step(loss, None if norm is None else float(norm)))
    torch.cuda.synchronize()
    return done

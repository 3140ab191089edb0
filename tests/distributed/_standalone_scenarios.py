"""A standalone MTP stage on two gloo ranks (PP=2), driven stage by stage (module-level for spawn).

megatron's pipeline schedules allocate on CUDA, so a scenario drives the two stages itself, one
microbatch after another, as a 1F1B schedule does: rank 0 (embedding, both decoder layers and
the MTP layer, no output layer) runs its forward and sends the shape, then the hidden states,
to rank 1 (output layer and losses, no MTP block), which receives them, calls
``set_input_tensor``, computes the loss and sends the gradient back. Sending the shape first is
what megatron's p2p exchange does for such a layout, so a skipped MTP stage may send fewer rows.
"""

from __future__ import annotations

import torch

import mtp_hooks
from mtp_hooks.demo import tiny_models

SEQ, VOCAB = 16, 128
LAYOUT = [["embedding", "decoder", "decoder", "mtp"], ["loss"]]


def build_stage(rank: int):
    spec = tiny_models.TinySpec(seq_length=SEQ, vocab_size=VOCAB, mtp_num_layers=1)
    torch.manual_seed(0)
    model = tiny_models.build_gpt(
        spec,
        attention="sdpa",
        pre_process=rank == 0,
        post_process=rank == 1,
        pipeline_model_parallel_size=2,
        pipeline_model_parallel_layout=LAYOUT,
        pipeline_dtype=torch.float32,
    )
    assert model.config.mtp_standalone
    return model


def batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    return ids, torch.arange(SEQ).unsqueeze(0).expand(2, -1), torch.roll(ids, -1, dims=1)


def microbatch(model, rank: int, train: bool = True) -> dict:
    """One microbatch through both stages; what this rank saw."""
    dist = torch.distributed
    ids, pos, labels = batch()
    model.zero_grad(set_to_none=True)
    tiny_models.reset_mtp_loss_tracker()
    with torch.set_grad_enabled(train):
        if rank == 0:
            out = model(ids, pos, None, labels=labels)
            dist.send(torch.tensor(out.shape), 1)
            dist.send(out.detach().contiguous(), 1)
            if train:
                grad = torch.empty_like(out)
                dist.recv(grad, 1)
                out.backward(grad)
            seen = {"rows": out.shape[0]}
        else:
            shape = torch.empty(3, dtype=torch.long)
            dist.recv(shape, 0)
            hidden = torch.empty(*shape.tolist())
            dist.recv(hidden, 0)
            hidden.requires_grad_(train)
            model.set_input_tensor(hidden)
            loss = model(ids, pos, None, labels=labels)
            if train:
                loss.float().mean().backward()
                dist.send(hidden.grad.contiguous(), 0)
            seen = {"rows": shape[0].item(), "loss": loss.detach().clone()}
    seen["mtp_loss"] = tiny_models.recorded_mtp_loss()
    seen["grads"] = {n: p.grad for n, p in model.named_parameters()}  # zero_grad sets new ones
    return seen


def _same(a: dict, b: dict) -> bool:
    """Bit-identical losses and gradients (a missing gradient equals one of zeros)."""
    for name, x in a["grads"].items():
        y = b["grads"][name]
        if (x is None or not x.any()) and (y is None or not y.any()):
            continue
        if x is None or y is None or not torch.equal(x, y):
            return False
    return "loss" not in a or torch.equal(a["loss"], b["loss"])


def standalone_stage(rank: int) -> dict:
    """Per-phase decisions on a standalone MTP stage and its loss stage."""
    model = build_stage(rank)
    counter = tiny_models.MTPForwards(model) if rank == 0 else None
    result: dict = {"mtp_process": bool(model.mtp_process), "post_process": model.post_process}
    plain = microbatch(model, rank)  # no mtp-hooks
    mtp_hooks.configure("eval=run+metrics")
    try:
        mtp_hooks.attach(model)
    except mtp_hooks.UnsupportedModelError as exc:
        result["metrics_refused"] = str(exc)
    mtp_hooks.configure("train=run,eval=skip")
    handle = mtp_hooks.attach(model)
    ran = microbatch(model, rank)
    mtp_hooks.configure("train=run:0")
    weightless = microbatch(model, rank)
    mtp_hooks.configure("train=skip")
    skipped = microbatch(model, rank)
    result.update(
        rows={"plain": plain["rows"], "run": ran["rows"], "skip": skipped["rows"]},
        run_equals_plain=_same(ran, plain),
        skip_equals_weight_zero=_same(skipped, weightless),
        skip_differs_from_run=not _same(skipped, ran),
        mtp_loss={"run": ran["mtp_loss"], "skip": skipped["mtp_loss"]},
        mtp_grads_after_skip=[
            n for n, g in skipped["grads"].items() if n.startswith("mtp.") and g is not None
        ],
    )
    mtp_hooks.configure("train=run,eval=skip")
    model.eval()
    evaluated = microbatch(model, rank, train=False)
    model.train()
    # a policy that differs between the stages: the loss stage follows what the MTP stage did
    mtp_hooks.configure("train=skip" if rank == 0 else "train=run")
    followed_skip = microbatch(model, rank)
    mtp_hooks.configure("train=run" if rank == 0 else "train=skip")
    followed_run = microbatch(model, rank)
    result.update(
        eval_rows=evaluated["rows"],
        followed={"skip": followed_skip["mtp_loss"], "run": followed_run["mtp_loss"]},
        followed_skip_equals_skip=_same(followed_skip, skipped),
        followed_run_equals_run=_same(followed_run, ran),
        stats=handle.stats(),
        mtp_forwards=None if counter is None else counter.n,
    )
    handle.remove()
    return result

"""Scenarios for ``+objective:kl``/``tv`` on each rank (module-level so ``spawn`` can import
them): TP=2 with the vocabulary split over the ranks."""

from __future__ import annotations

import torch

import mtp_hooks
from mtp_hooks.demo import tiny_models

from _scenarios import SEQ, VOCAB, _batch

DEPTHS = 2


def _model():
    spec = tiny_models.TinySpec(
        seq_length=SEQ,
        vocab_size=VOCAB,
        mtp_num_layers=DEPTHS,
        extra={"tensor_model_parallel_size": 2},
    )
    torch.manual_seed(0)
    model = tiny_models.build_gpt(spec, attention="local")
    mtp_hooks.clip_mtp_apart(model)
    return model


def _whole_vocabulary_objective(kind, drafts, policy, factor):
    """The objective in float64 over the whole vocabulary, each rank's shards gathered with
    megatron's own differentiable gather (its backward hands each rank its shard's part)."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    whole_policy = gather_from_tensor_model_parallel_region(policy.detach()).double()
    total = torch.zeros((), dtype=torch.float64)
    for depth, draft in enumerate(drafts, start=1):
        z = gather_from_tensor_model_parallel_region(draft).double()
        p = torch.softmax(whole_policy, dim=-1)[depth:]
        log_q = torch.log_softmax(z, dim=-1)[: SEQ - depth]
        if kind == "kl":
            per = torch.sum(p * (p.log() - log_q), dim=-1)
        else:
            per = torch.sum((log_q.exp() - p).abs(), dim=-1) / 2
        count = 2 * (SEQ - depth)  # every position whose label exists, both rows
        total = total + factor / DEPTHS * per.sum() / count
    return total


def _keeper(seen: list[torch.Tensor]):
    """A forward hook keeping copies of the output layer's logits: megatron's cross-entropy
    overwrites them in place."""

    def keep(layer, args, output):
        seen.append(output[0].clone())

    return keep


def objective_under_tp(rank: int) -> dict:
    """TP=2, logits split along the vocabulary: each rank's MTP gradients from ``kl`` and
    ``tv`` equal those of a whole-vocabulary float64 reference on the same logits, and the
    trunk's equal a skip's."""
    tiny_models.reset_mtp_loss_tracker(num_layers=DEPTHS)
    ids, pos, mask = _batch()
    out: dict = {}
    for kind in ("kl", "tv"):
        model = _model()
        handle = mtp_hooks.attach(model)
        mtp_hooks.configure("train=skip")
        model.train()
        model(ids, pos, mask, labels=ids).sum().backward()
        skipped = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        mtp_hooks.configure(f"train=run+detach+objective:{kind}")
        model(ids, pos, mask, labels=ids).sum().backward()
        got = {n: p.grad.clone() for n, p in model.named_parameters() if n.startswith("mtp.")}
        trunk_as_skip = all(
            torch.equal(skipped[n], p.grad)
            for n, p in model.named_parameters()
            if not n.startswith("mtp.")
        )
        handle.remove()
        mtp_hooks.testing.reset()

        reference = _model()
        seen: list[torch.Tensor] = []
        probe = reference.output_layer.register_forward_hook(_keeper(seen))
        reference.config.mtp_loss_scaling_factor, reference.config.mtp_detach_heads = 0.0, True
        reference.train()
        loss = reference(ids, pos, mask, labels=ids)
        probe.remove()
        objective = _whole_vocabulary_objective(kind, seen[:DEPTHS], seen[DEPTHS], 0.1)
        (loss.sum() + objective).backward()
        want = {n: p.grad for n, p in reference.named_parameters() if n.startswith("mtp.")}
        out[kind] = {
            "sharded": bool(model.output_layer.weight.shape[0] == VOCAB // 2),
            "close": all(torch.allclose(got[n], want[n], rtol=1e-4, atol=1e-7) for n in want),
            "largest": max(float(g.abs().max()) for g in got.values()),
            "trunk_as_skip": trunk_as_skip,
        }
    return out

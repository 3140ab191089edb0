"""Scenarios for ``+objective:kl``/``tv`` on each rank (module-level so ``spawn`` can import
them): TP=2 with the vocabulary split over the ranks."""

from __future__ import annotations

import torch

import mtp_hooks
from mtp_hooks.demo import tiny_models

from _scenarios import SEQ, VOCAB, _batch, _cp_model, _no_group, _on_this_cp_rank, _tp_model

DEPTHS = 2


def _model():
    return _depths(_tp_model(depths=DEPTHS)[0])


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


def objective_under_cp(rank: int) -> dict:
    """CP=2: each rank holds two chunks of the sequence (megatron's own split), and the target
    of a position ``i + depth`` may lie on the other rank. Each rank's objective equals a
    float64 value computed by hand from the whole sequence's logits, over the positions this
    rank holds and normalised by its own count, as each rank's ``process_mtp_loss``
    normalises megatron's cross-entropy; and its MTP weights get gradients."""
    tiny_models.reset_mtp_loss_tracker(num_layers=DEPTHS)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    mask = torch.ones(2, SEQ)
    mask[0, :5] = 0  # a prompt
    full = {
        "tokens": ids,
        "position_ids": torch.arange(SEQ).unsqueeze(0).expand(2, -1).contiguous(),
        "labels": torch.roll(ids, -1, dims=1),
        "mask": mask,
        "where": torch.arange(SEQ).unsqueeze(0).expand(2, -1).contiguous(),
    }
    local = _on_this_cp_rank(full)
    solo = _no_group()
    ranks = _ranks_of_positions(full)
    whole = _alone(_depths(_cp_model(cp=1, depths=DEPTHS)), solo)
    seen: list[torch.Tensor] = []
    probe = whole.output_layer.register_forward_hook(_keeper(seen))
    with torch.no_grad():
        whole(ids, full["position_ids"], None, labels=full["labels"], loss_mask=mask)
    probe.remove()
    out: dict = {}
    for kind in ("kl", "tv"):
        model = _depths(_cp_model(depths=DEPTHS))
        mtp_hooks.attach(model)
        mtp_hooks.configure(f"train=run+detach+objective:{kind}")
        model.train()
        args = (local["tokens"], local["position_ids"], None)
        output = model(*args, labels=local["labels"], loss_mask=local["mask"])
        carried = type(output.grad_fn).__name__
        value = output.grad_fn.saved_tensors[0]  # what MTPLossAutoScaler carries back
        output.sum().backward()
        grads = [p.grad for n, p in model.named_parameters() if n.startswith("mtp.")]
        mtp_hooks.testing.reset()
        mine = ranks == torch.distributed.get_rank()
        want = _share_of_objective(kind, seen[:DEPTHS], seen[DEPTHS], mask, mine, 0.1)
        out[kind] = {
            "local_seq": int(local["tokens"].shape[1]),
            "carried": carried,
            "value": float(value),
            "want": float(want),
            "trained": all(g is not None for g in grads) and any(bool(g.any()) for g in grads),
        }
    return out


def _alone(model, solo):
    """``model`` rolling its sequence on this rank alone (``solo``, a group of this rank):
    built while the CP=2 groups exist, it would otherwise trade sequence ends with the other
    rank, which holds the same whole sequence."""
    for module in model.modules():  # the model and its MTP modules roll; attention does not
        rolls = module is model or "MultiTokenPrediction" in type(module).__name__
        if rolls and hasattr(module, "cp_group"):
            module.cp_group = solo
    return model


def _depths(model):
    """``model`` as built, with its MTP weights clipped apart (``+detach`` needs it)."""
    mtp_hooks.megatron.clip_mtp_apart(model)
    return model


def _ranks_of_positions(full: dict) -> torch.Tensor:
    """``[SEQ]``: the CP rank that holds each position, from megatron's own split."""
    from megatron.core import parallel_state

    group = parallel_state.get_context_parallel_group()
    local = _on_this_cp_rank({"where": full["where"]})["where"][0]
    held = [torch.empty_like(local) for _ in range(group.size())]
    torch.distributed.all_gather(held, local.contiguous(), group=group)
    ranks = torch.empty(SEQ, dtype=torch.long)
    for r, positions in enumerate(held):
        ranks[positions] = r
    return ranks


def _share_of_objective(kind, drafts, policy, mask, mine, factor):
    """The objective over the positions ``mine`` of the whole sequence (whose targets may lie
    anywhere in it), normalised by this share's count of masked-in positions."""
    total = torch.zeros((), dtype=torch.float64)
    for depth, draft in enumerate(drafts, start=1):
        p = torch.softmax(policy.double(), dim=-1)[depth:]  # [s - d, b, v]
        log_q = torch.log_softmax(draft.double(), dim=-1)[: SEQ - depth]
        if kind == "kl":
            per = torch.sum(p * (p.log() - log_q), dim=-1)
        else:
            per = torch.sum((log_q.exp() - p).abs(), dim=-1) / 2
        rolled = torch.zeros_like(mask, dtype=torch.float64)
        rolled[:, : SEQ - depth] = mask[:, depth:]
        share = mine.double()[None] * rolled  # [b, s]
        weights = share.t()[: SEQ - depth]
        total = total + factor / DEPTHS * torch.sum(weights * per) / share.sum().clamp(min=1)
    return total

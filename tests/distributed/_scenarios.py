"""Scenarios run on each rank by tests/distributed (module-level so ``spawn`` can import them)."""

from __future__ import annotations

import torch

import mtp_hooks
from mtp_hooks.demo import tiny_models

SEQ, VOCAB = 16, 128


def _tp_model(depths: int = 1):
    spec = tiny_models.TinySpec(
        seq_length=SEQ,
        vocab_size=VOCAB,
        mtp_num_layers=depths,
        extra={"tensor_model_parallel_size": 2},
    )
    torch.manual_seed(0)
    model = tiny_models.build_gpt(spec, attention="local")
    return model, tiny_models.MTPForwards(model)


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(2, -1)
    # an explicit causal mask: megatron builds its default one on CUDA
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    return ids, pos, mask.expand(2, 1, SEQ, SEQ)


def agreeing_policy(rank: int) -> dict:
    """TP=2, verify on: run in train, skip in rollout; both ranks agree, nothing hangs."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tiny_models.reset_mtp_loss_tracker()
    model, counter = _tp_model()
    handle = mtp_hooks.attach(model, verify=True)
    mtp_hooks.configure("train=run,rollout=skip")
    ids, pos, mask = _batch()
    run_loss = model(ids, pos, mask, labels=ids)
    run_loss.sum().backward()
    recorded_after_run = tiny_models.recorded_mtp_loss()
    tiny_models.reset_mtp_loss_tracker()
    with mtp_hooks.phase("rollout"):
        skip_loss = model(ids, pos, mask, labels=ids)
        skip_loss.sum().backward()
    recorded_after_skip = tiny_models.recorded_mtp_loss()
    # the MTP loss logging all-reduce, after ranks agreed on skipping: must not hang
    MTPLossLoggingHelper.track_mtp_metrics(loss_scale=1.0, iteration=1, writer=None)
    return {
        "mtp_forwards": counter.n,
        "stats": handle.stats(),
        "recorded_after_run": recorded_after_run,
        "recorded_after_skip": recorded_after_skip,
        "losses_equal": bool(torch.equal(run_loss, skip_loss)),
        "loss_sum": float(run_loss.sum()),
    }


class RankDependent:
    """A broken policy: rank 0 runs MTP, every other rank skips it."""

    @mtp_hooks.plugins.hookimpl
    def should_run_mtp(self, model, phase):
        return torch.distributed.get_rank() == 0


def rank_dependent_plugin(rank: int) -> dict:
    """TP=2, verify on, a rank-dependent plugin: DecisionMismatchError on every rank."""
    tiny_models.reset_mtp_loss_tracker()
    model, counter = _tp_model()
    shared = model.config
    mtp_hooks.attach(model, verify=True)
    mtp_hooks.plugins.register(RankDependent(), name="rank-dependent")
    ids, pos, mask = _batch()
    try:
        model(ids, pos, mask, labels=ids)
    except mtp_hooks.DecisionMismatchError as exc:
        return {
            "raised": True,
            "message": str(exc),
            "mtp_forwards": counter.n,
            "gates_restored": model.config is shared and model.mtp_process is True,
        }
    return {"raised": False}


def verify_from_env(rank: int) -> dict:
    """MTP_HOOKS_VERIFY=1 turns verification on without touching attach()."""
    import os

    os.environ["MTP_HOOKS_VERIFY"] = "1"
    return rank_dependent_plugin(rank)


def policy_file_edits(rank: int) -> dict:
    """Two ranks, one policy file edited mid-run: nothing changes until reload(), which makes
    every rank adopt what rank 0 read, even where this rank's own view of the file differs."""
    import os
    from pathlib import Path

    folder = Path(os.environ["MTP_TEST_DIR"])
    shared, stale = folder / "mtp.toml", folder / f"rank{rank}-stale.toml"
    os.environ.update(MTP_HOOKS_CONFIG=str(shared), MTP_HOOKS_CONFIG_POLL="0")
    barrier = torch.distributed.barrier
    if rank == 0:
        shared.write_text('[policy]\neval = "skip"\n')
    barrier()
    seen = [mtp_hooks.decide(None, "eval").run]
    barrier()
    if rank == 0:
        shared.write_text('[policy]\neval = "run"\n')
    barrier()
    seen.append(mtp_hooks.decide(None, "eval").run)  # the edit is not picked up on its own
    stale.write_text('[policy]\neval = "skip"\n')
    if rank == 1:  # this rank reads an older copy of the file, as a slow filesystem would
        os.environ["MTP_HOOKS_CONFIG"] = str(stale)
    mtp_hooks.reload()
    seen.append(mtp_hooks.decide(None, "eval").run)
    return {"seen": seen}


class KeepMetrics:
    def __init__(self) -> None:
        self.seen: list[mtp_hooks.MTPMetrics] = []

    @mtp_hooks.plugins.hookimpl
    def mtp_metrics(self, model, phase, metrics):
        self.seen.append(metrics)


def metrics_under_tp(rank: int) -> dict:
    """TP=2, vocab-parallel logits, two MTP depths: the recorded loss and acceptance against a
    reference computed from the whole output weight, and against megatron's own training log."""
    import torch.nn.functional as F
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from mtp_hooks.megatron.drafting._engine_walk import expected_walk

    depths = 2
    model, _ = _tp_model(depths)
    model.eval()
    ids, pos, mask = _batch()
    hidden: list[torch.Tensor] = []
    probe = model.mtp.register_forward_hook(lambda m, a, out: hidden.append(out.detach()))
    with torch.no_grad():
        model(ids, pos, mask, labels=ids)  # not recorded: only the MTP hidden states are kept
    probe.remove()
    shards = [torch.empty_like(model.output_layer.weight) for _ in range(2)]
    torch.distributed.all_gather(shards, model.output_layer.weight.detach().contiguous())
    weight = torch.cat(shards)  # [VOCAB, hidden]: the whole output layer
    chunks = torch.chunk(hidden[0], 1 + depths, dim=0)
    # Depth 1 at position i predicts labels[i + 1]; make it right at every even position, so
    # acceptance is neither 0 nor 1 and both vocab shards hold winning tokens.
    depth1 = (chunks[1] @ weight.t()).argmax(-1).t()  # [b, s]
    labels = ids.clone()
    labels[:, 1::2] = depth1[:, 0 : SEQ - 1 : 2]
    reference = []
    rolled, valid = labels, torch.ones_like(labels, dtype=torch.float)
    for depth in range(depths):
        logits = (chunks[depth + 1] @ weight.t()).transpose(0, 1)  # [b, s, VOCAB]
        rolled = torch.cat([rolled[:, 1:], torch.zeros_like(rolled[:, :1])], dim=1)
        valid = torch.cat([valid[:, 1:], torch.zeros_like(valid[:, :1])], dim=1)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), rolled.reshape(-1), reduction="none")
        hits = (logits.argmax(-1) == rolled) & valid.bool()
        reference.append(
            [float((loss * valid.reshape(-1)).sum() / valid.sum()), float(hits.sum() / valid.sum())]
        )
    winners_on_rank1 = int((depth1 >= VOCAB // 2).sum())
    policy = torch.softmax(chunks[0] @ weight.t(), dim=-1)  # [s, b, VOCAB]
    sampled = []  # sampled drafts and target: the chance the two are equal, sum_x q(x) p(x)
    chain = torch.zeros(policy.shape[1], SEQ, depths, dtype=torch.float64)  # [b, s, depth]
    reach = torch.ones(SEQ, policy.shape[1], dtype=torch.float64)
    for depth in range(depths):
        drafts = torch.softmax(chunks[depth + 1] @ weight.t(), dim=-1)[: SEQ - depth - 1]
        ahead = policy[depth + 1 :]  # the policy at i + depth + 1
        chance = (drafts * ahead).sum(-1)  # [s - depth - 1, b]
        sampled.append(float(chance.mean()))
        reach = reach[: SEQ - depth - 1] * chance.double()
        chain[:, : SEQ - depth - 1, depth] = reach.t()
    region = torch.zeros(policy.shape[1], SEQ, dtype=torch.bool)
    region[:, : SEQ - 1] = True  # depth 1 drafts from every position with a next token
    walk_accepted, walk_steps = expected_walk(chain, region)
    single = None  # the engine's drafts one request at a time, by megatron's own call under TP
    if callable(getattr(model, "compute_mtp_single_step", None)):
        from engine_reference import one_request_at_a_time

        hidden_in = chunks[0].contiguous()
        single = one_request_at_a_time(
            model, hidden_in, ids, pos, labels, torch.ones_like(labels), weight
        )
    keep = KeepMetrics()
    mtp_hooks.plugins.register(keep)
    mtp_hooks.attach(model)
    mtp_hooks.configure("eval=run+metrics")
    with torch.no_grad():
        model(ids, pos, mask, labels=labels)
    tiny_models.reset_mtp_loss_tracker(num_layers=depths)
    model.train()
    with torch.no_grad(), mtp_hooks.phase("eval"):
        model(ids, pos, mask, labels=labels)  # megatron logs this one too, in training mode
    tracker = MTPLossLoggingHelper.tracker
    in_eval, in_training = keep.seen
    # megatron-core 0.16 keeps losses under "values", later releases under "loss_values"
    newer = hasattr(MTPLossLoggingHelper, "save_metrics_to_tracker")
    losses_key = "loss_values" if newer else "values"
    megatron_acceptance = None
    if "correct_values" in tracker and tracker["total_values"].any():
        megatron_acceptance = (tracker["correct_values"] / tracker["total_values"]).tolist()
    return {
        "reference": reference,
        "winners_on_rank1": winners_on_rank1,
        "eval": [list(in_eval.loss), list(in_eval.acceptance)],
        "sampled": [sampled, list(in_eval.sampled_acceptance)],
        "sampled_length": [float(walk_accepted / walk_steps), in_eval.sampled_accepted_length],
        "single_position": [
            single,
            [
                in_eval.single_position_accepted_length,
                in_eval.single_position_sampled_accepted_length,
            ],
        ],
        "training": [list(in_training.loss), list(in_training.acceptance)],
        "megatron": [tracker[losses_key].tolist(), megatron_acceptance],
    }


def loss_mask_under_tp(rank: int) -> dict:
    """TP=2: a block's MTP loss mask gives every rank's shards the gradients of a forward that
    passes the mask as loss_mask, and leaves the LM loss as it was."""
    tiny_models.reset_mtp_loss_tracker()
    ids, pos, mask = _batch()
    weights = torch.zeros(ids.shape)
    weights[:, SEQ // 2 :] = 1.0
    results = []
    for hooked in (True, False):
        model, _ = _tp_model()
        model.train()
        if hooked:
            handle = mtp_hooks.attach(model)
            with mtp_hooks.mtp_loss_mask(weights):
                loss = model(ids, pos, mask, labels=ids)
        else:
            loss = model(ids, pos, mask, labels=ids, loss_mask=weights)
        loss.sum().backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (hooked_loss, hooked_grads), (plain_loss, plain_grads) = results
    model, _ = _tp_model()
    unmasked = model(ids, pos, mask, labels=ids)
    unmasked.sum().backward()
    return {
        "loss_equal": bool(torch.equal(hooked_loss, plain_loss)),
        "lm_loss_unchanged": bool(torch.equal(hooked_loss, unmasked.detach())),
        "grads_equal": all(torch.equal(hooked_grads[n], plain_grads[n]) for n in plain_grads),
        "mask_mattered": any(
            not torch.equal(plain_grads[n], p.grad) for n, p in model.named_parameters()
        ),
        "stats": handle.stats(),
    }


def controller_decisions(rank: int) -> dict:
    """Each rank collects its own eval figures (rank 0 a good drafter, rank 1 a poor one);
    update() reduces them over the data-parallel group, token-weighted, so both ranks decide
    the same weight."""
    from mtp_hooks_drafting import AcceptanceController

    controller = AcceptanceController(target=1.0, below=0.3, above=None)
    mtp_hooks.plugins.register(controller, name="drafter")
    local = [(1.6, 100), (0.2, 300)][rank]  # pooled: (160 + 60) / 400 = 0.55 -> below
    controller.mtp_metrics(
        None,
        "eval",
        mtp_hooks.MTPMetrics(
            loss=(2.0,),
            acceptance=(0.5,),
            tokens=(local[1],),
            forwards=1,
            chain_acceptance=(0.5,),
            accepted_length=local[0],
        ),
    )
    first = controller.update()
    second = controller.update(
        mtp_hooks.MTPMetrics(
            loss=(2.0,),
            acceptance=(0.5,),
            tokens=(100,),
            forwards=1,
            chain_acceptance=(0.5,),
            accepted_length=[1.9, 1.5][rank],
        )
    )  # pooled over window 1: 1.7 -> above -> skip
    decision = mtp_hooks.decide(None, "train")
    return {"weights": [first, second], "value": controller.value, "run": decision.run}


def controller_refusal(rank: int) -> dict:
    """Rank 0 collected a figure of a one-depth model for a controller that reads depth 2; rank 1
    collected nothing. Both must raise at update(), neither may wait for the other."""
    from mtp_hooks_drafting import AcceptanceController

    controller = AcceptanceController(
        target=0.5, below=0.3, above=None, metric="acceptance", depth=2
    )
    if rank == 0:
        controller.collect(
            mtp_hooks.MTPMetrics(loss=(2.0,), acceptance=(0.5,), tokens=(100,), forwards=1)
        )
    try:
        controller.update()
    except mtp_hooks.PolicyError as exc:
        return {"raised": str(exc)}
    return {"raised": None}


def speculation_advice(rank: int) -> dict:
    """Rank 0 saw a good drafter in its engine, rank 1 a stale one: each alone would draft a
    different number of tokens; averaged over the group, both draft the same."""
    from mtp_hooks_drafting import acceptance_from_counts, recommend_num_speculative_tokens

    local = acceptance_from_counts(100, [[90, 80], [10, 0]][rank])
    alone = recommend_num_speculative_tokens(local, step_cost=0.45, group=_no_group())
    shared = recommend_num_speculative_tokens(local, step_cost=0.45)
    return {
        "alone": alone.num_speculative_tokens,
        "shared": shared.num_speculative_tokens,
        "chain": list(shared.chain_acceptance),
    }


def _no_group():
    """A one-rank group of this rank alone: what a rank would decide by itself."""
    import torch

    groups = [torch.distributed.new_group([r]) for r in range(torch.distributed.get_world_size())]
    return groups[torch.distributed.get_rank()]


def _cp_model(cp: int = 2, depths: int = 1):
    spec = tiny_models.TinySpec(
        seq_length=SEQ,
        vocab_size=VOCAB,
        mtp_num_layers=depths,
        extra={"context_parallel_size": cp},
    )
    torch.manual_seed(0)
    return tiny_models.build_gpt(spec, attention="sdpa")  # the demo's attention gathers CP


def _on_this_cp_rank(batch: dict) -> dict:
    """This rank's share of ``batch``, sliced by megatron's own function (whose arguments
    differ between releases)."""
    import inspect

    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    params = inspect.signature(get_batch_on_this_cp_rank).parameters
    kwargs: dict = {"is_hybrid_cp": False} if "is_hybrid_cp" in params else {}
    if "cp_group" in params:
        kwargs["cp_group"] = parallel_state.get_context_parallel_group()
    return get_batch_on_this_cp_rank(dict(batch), **kwargs)


def loss_mask_under_cp(rank: int) -> dict:
    """CP=2: on each rank's share of an answer-only batch, a block's mask and +mask:labels give
    the gradients of a forward that passes the mask as loss_mask, and megatron's LM loss is
    as it was. Per-rank gradients are compared before any reduction: each rank's MTP loss
    rolls the mask across the CP boundary (megatron's roll_tensor), so a mask that reached MTP
    differently on one rank would show there."""
    tiny_models.reset_mtp_loss_tracker()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, : SEQ // 2] = -100  # the prompt, as answer-only SFT labels it
    labels[0, -2:] = -100  # and padding
    full = {
        "tokens": ids,
        "position_ids": torch.arange(SEQ).unsqueeze(0).expand(2, -1).contiguous(),
        "labels": labels,
        "weights": (labels != -100).float(),
    }
    local = _on_this_cp_rank(full)
    results, stats = {}, {}
    for how in ("block", "labels", "plain", "unmasked"):
        model = _cp_model()
        model.train()
        args = (local["tokens"], local["position_ids"], None)
        if how == "block":
            handle = mtp_hooks.attach(model)
            with mtp_hooks.mtp_loss_mask(local["weights"]):
                loss = model(*args, labels=local["labels"])
        elif how == "labels":
            handle = mtp_hooks.attach(model)
            mtp_hooks.configure("train=run+mask:labels")
        if how == "labels":
            loss = model(*args, labels=local["labels"])
        elif how == "plain":
            loss = model(*args, labels=local["labels"], loss_mask=local["weights"])
        elif how == "unmasked":
            loss = model(*args, labels=local["labels"])
        loss.sum().backward()
        if how in ("block", "labels"):
            stats[how] = handle.stats()
            handle.remove()
            mtp_hooks.testing.reset()
        results[how] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})

    # The setting itself: the same weights built without CP, on the whole sequence, give this
    # rank's share of the language-model loss (so the demo's attention gathers CP correctly).
    whole = _cp_model(cp=1)
    with torch.no_grad():
        reference = whole(ids, full["position_ids"], None, labels=labels)
    share = _on_this_cp_rank({"loss": reference})["loss"]

    def same(a: str, b: str) -> bool:
        (la, ga), (lb, gb) = results[a], results[b]
        return bool(torch.equal(la, lb)) and all(torch.equal(ga[n], gb[n]) for n in ga)

    return {
        "local_seq": int(local["tokens"].shape[1]),
        "lm_loss_as_without_cp": bool(torch.allclose(results["plain"][0], share, atol=1e-5)),
        "block_equals_loss_mask": same("block", "plain"),
        "labels_equals_loss_mask": same("labels", "plain"),
        "lm_loss_unchanged": bool(torch.equal(results["block"][0], results["unmasked"][0])),
        "mask_mattered": not same("plain", "unmasked"),
        "stats": stats,
    }

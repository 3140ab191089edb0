"""The drafter where it drafts: an RL-shaped loop whose rollouts speculate with the MTP layers.

Run on one GPU with FlashAttention 4 installed (megatron-core's ``DynamicInferenceEngine``
needs it for its paged KV cache)::

    python benchmarks/rl_drafter/gpu_rl_drafter.py --out DIR

What it does, in one process:

1. **The corpus.** A phrase language: a bank of random phrases (token strings of 4 to 10
   tokens over the vocabulary), joined by a Markov chain over phrases (each phrase has four
   possible successors, the first drawn half the time). Inside a phrase every token is
   predictable from the ones before it; at a phrase end only the successor is, and only half
   the time. A trained drafter therefore reaches a high but partial acceptance.
2. **Pretraining** a GPTModel (megatron's local layer specs, bf16 weights with fp32 master
   copies, AdamW) with two MTP layers trained as megatron does by default.
3. **The policy moves.** The RL-shaped phase is a scheduled shift of the target distribution:
   from its first step the training data come from a new phrase bank, as a policy's own
   outputs drift under RL. The data order is fixed by the seed, so every arm trains its trunk
   on exactly the same batches, and rollouts never feed back into training (so a drafter can
   change the rollouts' speed but never the policy).
4. **Four arms**, each from the same pretrained weights and optimizer state: (A) ``train=skip``;
   (B) MTP trained with the policy, undetached (megatron's default); (C) ``train=run+detach``;
   (D) ``train=auto+detach`` under an :class:`~mtp_hooks_drafting.AcceptanceController` fed
   with the engine's own acceptance (:func:`~mtp_hooks_drafting.acceptance_from_counts`),
   training MTP only while the drafter is below its target.
   Two more arms measure what MTP trains on (``--arms P,R``). Their batches are shaped as RL
   batches are: a prompt from the pretraining language, a response of random length from the
   new one, then padding (token 0, as frameworks pad with EOS). The policy's loss counts the
   response only, and MTP is detached so both arms train bit-identical policies. (P) passes no
   ``loss_mask`` to the model, as Megatron-Bridge's ``gpt_step`` does, so megatron's MTP loss
   counts every position: prompt, response and padding. (R) makes the same call inside
   ``mtp_hooks.mtp_loss_mask(response)``, so MTP trains on the response only. Their rollouts
   start from prompts of the pretraining language, as the batches do.
   Two more measure what MTP trains toward (``--arms C,K,T``): (K) ``+objective:kl``, the
   policy's own next-token distribution, and (T) ``+objective:tv``, against C's
   cross-entropy, all detached, so K's and T's trunks end bit-identical to C's.
   ``--temperature 1`` rolls out by sampling, as RL does; the teacher-forced figures then
   carry the sampled acceptance too.
5. **Every ``--every`` steps**, on the same prompts for every arm: greedy rollouts in
   ``DynamicInferenceEngine`` drafting 0, 1 and 2 tokens (tokens/s, per-position acceptance,
   accepted length), and the teacher-forced ``+metrics`` of a log-prob forward over the
   undrafted rollouts. From those teacher-forced figures and the step costs measured after
   pretraining, :func:`~mtp_hooks_drafting.recommend_num_speculative_tokens` picks the k
   that arm D would roll out with; its tokens/s is read off the same measurement.

Gradient clipping is per group, trunk and MTP weights apart, as megatron's optimizer does for
weights tagged ``grad_norm_group='mtp'``: with one global norm, MTP's gradients would change
the trunk's clip coefficient and no detach could keep the policy's update as it is.

Output: ``rl_drafter.json`` (every measurement and the summary), a markdown summary on stdout,
and ``rl_drafter.png`` (``--plot FILE`` redraws it). Without CUDA (``--device cpu``, a smoke
run for the tests) rollouts are plain greedy forward loops without speculation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rl_drafter_corpus import PhraseLanguage, prompts_at, rl_batch  # noqa: E402
from rl_drafter_report import plot, report  # noqa: E402
from rl_drafter_rollouts import EngineRollouts, PlainRollouts, measure  # noqa: E402
from rl_drafter_training import DEPTH, Trainer, build_model, train_step  # noqa: E402

ARMS = {
    "A": "train=skip,logprob=run+metrics",
    "B": "train=run,logprob=run+metrics",
    "C": "train=run+detach,logprob=run+metrics",
    "D": "train=auto+detach,logprob=run+metrics",
    "P": "train=run+detach,logprob=run+metrics",
    "R": "train=run+detach,logprob=run+metrics",
    "K": "train=run+detach+objective:kl,logprob=run+metrics",
    "T": "train=run+detach+objective:tv,logprob=run+metrics",
}
# The arms whose batches are prompt + response + padding, and whether MTP's loss is masked to
# the response (with mtp_hooks.mtp_loss_mask) or counts every position (no loss_mask at all).
RESPONSE_ONLY = {"P": False, "R": True}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--phrases", type=int, default=1024, help="phrases per bank")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--mtp-scale", type=float, default=0.3, help="mtp_loss_scaling_factor")
    p.add_argument("--pretrain-steps", type=int, default=800)
    p.add_argument("--rl-steps", type=int, default=300)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--arms", default="A,B,C,D")
    p.add_argument("--prompts", type=int, default=8, help="rollout batch")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--gen", type=int, default=96, help="tokens generated per prompt")
    p.add_argument(
        "--target-fraction",
        type=float,
        default=0.9,
        help="D's target: this fraction of the engine's accepted length right after pretraining",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="rollouts: 0 greedy (top_k=1); above 0 sampled at this temperature, as RL rolls "
        "out, the engine accepting a draft only when it equals the sampled token",
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", default="cuda", help="cuda; cpu only for a smoke run")
    p.add_argument("--out", default=".")
    p.add_argument("--plot", default=None, help="redraw the plot of a results JSON, and stop")
    return p.parse_args(argv)


# -- the experiment -------------------------------------------------------------------------------
def run(args, save=lambda results: None) -> dict:
    import torch

    import mtp_hooks
    from mtp_hooks.demo import tiny_models
    from mtp_hooks_drafting import (
        AcceptanceController,
        acceptance_from_counts,
        recommend_num_speculative_tokens,
    )

    os.environ["MTP_HOOKS_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    tiny_models.init_single_process()
    tiny_models.reset_mtp_loss_tracker(num_layers=DEPTH, device=args.device)
    model = build_model(args)
    if "mtp_detach_heads" in type(model.config).__dataclass_fields__:  # C and D detach
        mtp_hooks.megatron.clip_mtp_apart(model)
    n_params = sum(p.numel() for p in model.parameters())
    trainer = Trainer(model, args.lr, args.clip)
    handle = mtp_hooks.attach(model)
    mtp_hooks.declare_phase("logprob")
    old, new = (PhraseLanguage(args.vocab, args.phrases, args.seed + s) for s in (1, 2))

    mtp_hooks.configure("train=run,logprob=run+metrics")
    pre_ms = [
        train_step(model, trainer, old.sample(args.batch, args.seq, (args.seed, 0, s)), args.device)
        for s in range(args.pretrain_steps)
    ]
    pretrained = trainer.state()

    kind = EngineRollouts if args.device == "cuda" else PlainRollouts
    engines = {k: kind(model, k, args) for k in range(DEPTH + 1)}
    # Warm up every engine (FlashAttention compiles per shape on first use), at both batches.
    for engine in engines.values():
        engine(prompts_at(new, args, 0), args.gen)
        engine(prompts_at(new, args, 0)[:1], args.gen)
    fresh = measure(model, handle, engines, prompts_at(old, args, 0), args, batch1=True)
    calib = measure(model, handle, engines, prompts_at(new, args, 0), args, batch1=True)
    seconds_per_step = [
        calib["engine"][k]["seconds"] / calib["engine"][k]["steps"] for k in engines
    ]
    fresh_length = fresh["engine"].get(DEPTH, {}).get("accepted_length", 0.0)
    target = args.target_fraction * fresh_length

    results: dict = {
        "args": vars(args),
        "parameters": n_params,
        "pretrain_step_ms": statistics.median(pre_ms[len(pre_ms) // 2 :]),
        "fresh_on_old_data": fresh,
        "at_shift": calib,
        "seconds_per_step": seconds_per_step,
        "controller_target": target,
        "arms": {},
    }
    trunks = {}
    for arm in args.arms.split(","):
        mtp_hooks.testing.reset()
        mtp_hooks.declare_phase("logprob")
        mtp_hooks.configure(ARMS[arm])
        controller = None
        if arm == "D":
            controller = AcceptanceController(target=target, below=args.mtp_scale, above=None)
            mtp_hooks.plugins.register(controller, name="drafter")
        trainer.load(pretrained)
        rows, step_ms, trained = [], [], 0
        for step in range(args.rl_steps + 1):
            if step % args.every == 0:
                row = measure(
                    model,
                    handle,
                    engines,
                    prompts_at(old if arm in RESPONSE_ONLY else new, args, step),
                    args,
                    batch1=step in (0, args.rl_steps),
                )
                tf = row["teacher_forced"]["chain_acceptance"]
                advice = recommend_num_speculative_tokens(tf, step_cost=seconds_per_step)
                row.update(
                    step=step,
                    recommended_k=advice.num_speculative_tokens,
                    expected_speedups=list(advice.speedups),
                )
                if controller is not None:
                    drafted = row["engine"][DEPTH]
                    figures = acceptance_from_counts(drafted["drafts"], drafted["accepted"])
                    weight = controller.update(figures)
                    row["controller"] = {"value": controller.value, "weight": weight}
                row["train_decision_run"] = mtp_hooks.decide(model, "train").run
                del row["tokens_k0"]
                rows.append(row)
                print(json.dumps({"arm": arm, **summary_row(row)}), flush=True)
            if step < args.rl_steps:
                trained += mtp_hooks.decide(model, "train").run
                seed = (args.seed, 1, step)
                if arm in RESPONSE_ONLY:
                    batch = rl_batch(old, new, args, seed, RESPONSE_ONLY[arm])
                    step_ms.append(train_step(model, trainer, None, args.device, batch))
                else:
                    ids = new.sample(args.batch, args.seq, seed)
                    step_ms.append(train_step(model, trainer, ids, args.device))
        trunks[arm] = [t.cpu().clone() for t in trainer.trunk()]
        results["arms"][arm] = {
            "policy": ARMS[arm],
            "rows": rows,
            "train_step_ms": step_ms,
            "mtp_trained_steps": trained,
        }
        save(results)  # what a run cut short had measured stays
    if "A" in trunks:
        for arm, trunk in trunks.items():
            diff = max(float((a - b).abs().max()) for a, b in zip(trunks["A"], trunk, strict=True))
            same = all(torch.equal(a, b) for a, b in zip(trunks["A"], trunk, strict=True))
            results["arms"][arm]["trunk_vs_A"] = {"bit_identical": same, "max_abs_diff": diff}
    for arm in ("K", "T"):  # a distillation target never trains the trunk: C's, bit for bit
        if "C" in trunks and arm in trunks:
            same = all(torch.equal(a, b) for a, b in zip(trunks["C"], trunks[arm], strict=True))
            results["arms"][arm]["trunk_vs_C"] = {"bit_identical": same}
    if "P" in trunks and "R" in trunks:  # the mask arms train the same policy
        same = all(torch.equal(a, b) for a, b in zip(trunks["P"], trunks["R"], strict=True))
        results["arms"]["R"]["trunk_vs_P"] = {"bit_identical": same}
    handle.remove()
    return results


def summary_row(row: dict) -> dict:
    tf = row["teacher_forced"]
    out = {"step": row.get("step"), "tf_len": round(tf["accepted_length"], 3)}
    if tf.get("sampled_accepted_length") is not None:
        # Both sampled figures, so that a run cut short keeps them in its log: the walk, and
        # the per-position mean (the sum of the chain chances) that it replaced.
        out["tf_sampled_len"] = round(tf["sampled_accepted_length"], 3)
        out["tf_sampled_mean"] = round(sum(tf["sampled_chain_acceptance"]), 3)
    if tf.get("single_position_accepted_length") is not None:
        out["tf_single_len"] = round(tf["single_position_accepted_length"], 3)
    if tf.get("single_position_sampled_accepted_length") is not None:
        out["tf_single_sampled_len"] = round(tf["single_position_sampled_accepted_length"], 3)
    for k, e in row["engine"].items():
        out[f"k{k}_tok_s"] = round(e["tokens_per_s"], 1)
        if "accepted_length" in e:
            out[f"k{k}_len"] = round(e["accepted_length"], 3)
        if "alone_accepted_length" in e:
            out[f"k{k}_alone_len"] = round(e["alone_accepted_length"], 3)
    out["rec_k"] = row.get("recommended_k")
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.plot:
        with open(args.plot) as f:
            plot(json.load(f), os.path.splitext(args.plot)[0] + ".png")
        return
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "rl_drafter.json")

    def save(results: dict) -> None:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)

    results = run(args, save)
    save(results)
    print(report(results))
    try:
        plot(results, os.path.join(args.out, "rl_drafter.png"))
    except ImportError:
        pass


if __name__ == "__main__":
    main()

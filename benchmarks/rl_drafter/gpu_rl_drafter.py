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
   (D) ``train=auto+detach`` under an :class:`~mtp_hooks.framework.AcceptanceController` fed
   with the engine's own acceptance (:func:`~mtp_hooks.framework.acceptance_from_counts`),
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
   pretraining, :func:`~mtp_hooks.framework.recommend_num_speculative_tokens` picks the k
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
import copy
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rl_drafter_report import plot, report  # noqa: E402

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
PAD = 0  # the phrase banks draw tokens from 1 on, so padding is a token of its own
DEPTH = 2  # MTP layers, and the most tokens the engine drafts


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


# -- the corpus ---------------------------------------------------------------------------------
class PhraseLanguage:
    """Random phrases joined by a Markov chain over phrases (see the module docstring)."""

    def __init__(self, vocab: int, phrases: int, seed: int) -> None:
        import numpy as np

        rng = np.random.default_rng(seed)
        lengths = rng.integers(4, 11, size=phrases)
        self.phrases = [rng.integers(1, vocab, size=n) for n in lengths]
        self.successors = rng.integers(0, phrases, size=(phrases, 4))
        self.weights = np.array([0.5, 0.2, 0.15, 0.15])

    def sample(self, batch: int, length: int, seed: tuple[int, ...]):
        """``batch`` sequences of ``length`` tokens, a pure function of ``seed``."""
        import numpy as np
        import torch

        rng = np.random.default_rng(list(seed))
        rows = []
        for _ in range(batch):
            at, out, n = int(rng.integers(len(self.phrases))), [], 0
            while n < length:
                out.append(self.phrases[at])
                n += len(self.phrases[at])
                at = int(self.successors[at, rng.choice(4, p=self.weights)])
            rows.append(np.concatenate(out)[:length])
        return torch.from_numpy(np.stack(rows)).long()


# -- the model and its optimizer ------------------------------------------------------------
def build_model(args):
    import torch

    from mtp_hooks.demo import tiny_models

    cuda = args.device == "cuda"
    spec = tiny_models.TinySpec(
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_attention_heads=args.heads,
        ffn_hidden_size=4 * args.hidden,
        vocab_size=args.vocab,
        seq_length=max(args.seq, args.prompt_len + args.gen + DEPTH + 1),
        mtp_num_layers=DEPTH,
        swiglu=True,
        rmsnorm=True,
        bias=False,
        params_dtype=torch.bfloat16 if cuda else torch.float32,
        extra={"mtp_loss_scaling_factor": args.mtp_scale},
    )
    torch.manual_seed(args.seed)
    model = tiny_models.build_gpt(spec, attention="local" if cuda else "sdpa")
    return model.to(args.device)


@dataclass
class Trainer:
    """fp32 master weights and AdamW over a (bf16) megatron model; trunk and MTP weights are
    clipped apart, each by its own gradient norm."""

    model: object
    lr: float
    clip: float
    params: list = field(default_factory=list)
    master: list = field(default_factory=list)
    is_mtp: list = field(default_factory=list)
    optimizer: object = None

    def __post_init__(self) -> None:
        import torch

        mtp = {id(p) for p in self.model.mtp.parameters()}
        self.params = list(self.model.parameters())
        self.is_mtp = [id(p) in mtp for p in self.params]
        self.master = [torch.nn.Parameter(p.detach().float().clone()) for p in self.params]
        self.optimizer = torch.optim.AdamW(
            self.master, lr=self.lr, betas=(0.9, 0.95), weight_decay=0.01
        )

    def step(self) -> None:
        import torch

        for m, p in zip(self.master, self.params, strict=True):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        for mtp in (False, True):
            group = [
                m
                for m, t in zip(self.master, self.is_mtp, strict=True)
                if t is mtp and m.grad is not None
            ]
            if group and self.clip > 0:
                torch.nn.utils.clip_grad_norm_(group, self.clip)
        self.optimizer.step()
        with torch.no_grad():
            for m, p in zip(self.master, self.params, strict=True):
                p.copy_(m)
        for m in self.master:
            m.grad = None

    def trunk(self) -> list:
        """The fp32 master copies of the trunk's weights (embedding and output layer included)."""
        return [m.detach() for m, t in zip(self.master, self.is_mtp, strict=True) if not t]

    def state(self) -> dict:
        return copy.deepcopy({"master": self.master, "opt": self.optimizer.state_dict()})

    def load(self, state: dict) -> None:
        import torch

        with torch.no_grad():
            for m, s, p in zip(self.master, state["master"], self.params, strict=True):
                m.copy_(s)
                p.copy_(s)
        self.optimizer.load_state_dict(copy.deepcopy(state["opt"]))


def train_step(model, trainer: Trainer, ids, device: str, batch=None) -> float:
    """One training step under phase ``train``; returns its wall time in ms.

    Without ``batch`` every position but the last counts, for the policy's loss and MTP's
    alike, through the ``loss_mask`` handed to the model. With an :class:`RLBatch` the policy's
    loss counts its response; the model gets no ``loss_mask``, and MTP's loss is masked to the
    response when ``batch.mtp_response_only`` is set.
    """
    import contextlib

    import torch

    import mtp_hooks

    ids = (ids if batch is None else batch.ids).to(device)
    pos = torch.arange(ids.shape[1], device=device).unsqueeze(0).expand_as(ids)
    labels = torch.roll(ids, -1, dims=1)
    if batch is None:
        mask = torch.ones_like(ids, dtype=torch.float32)
        mask[:, -1] = 0
        kwargs, block = {"loss_mask": mask}, contextlib.nullcontext()
    else:
        mask, kwargs = batch.response.to(device), {}
        block = (
            mtp_hooks.mtp_loss_mask(mask) if batch.mtp_response_only else contextlib.nullcontext()
        )
    sync(device)
    start = time.perf_counter()
    with mtp_hooks.phase("train"), block:
        loss = model(ids, pos, None, labels=labels, **kwargs)
        (loss.float() * mask).sum().div(mask.sum()).backward()
    trainer.step()
    sync(device)
    return (time.perf_counter() - start) * 1e3


@dataclass
class RLBatch:
    """Prompts, responses and padding in one batch (see the module docstring)."""

    ids: object  # [batch, seq] tokens
    response: object  # [batch, seq] float: 1 where the next token (the label) is a response's
    mtp_response_only: bool


def rl_batch(prompts: PhraseLanguage, responses: PhraseLanguage, args, seed: tuple, only: bool):
    """A batch of ``prompt-len`` prompt tokens, a response of ``gen // 2`` to ``seq -
    prompt-len`` tokens and padding to ``seq``; a pure function of ``seed``."""
    import numpy as np
    import torch

    rng = np.random.default_rng(list(seed))
    room = args.seq - args.prompt_len
    lengths = rng.integers(min(args.gen // 2, room), room + 1, size=args.batch)
    head = prompts.sample(args.batch, args.prompt_len, (*seed, 0))
    body = responses.sample(args.batch, room, (*seed, 1))
    ids = torch.full((args.batch, args.seq), PAD, dtype=torch.long)
    response = torch.zeros(args.batch, args.seq)
    ids[:, : args.prompt_len] = head
    for row, n in enumerate(lengths.tolist()):
        ids[row, args.prompt_len : args.prompt_len + n] = body[row, :n]
        # label i is token i + 1: the labels that are response tokens start at the prompt's last
        response[row, args.prompt_len - 1 : args.prompt_len + n - 1] = 1
    return RLBatch(ids, response, only)


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


# -- rollouts ------------------------------------------------------------------------------------
@dataclass
class Rollout:
    """What one batch of greedy rollouts gave."""

    tokens: list  # generated tokens per prompt
    seconds: float
    steps: int
    drafts: list  # per draft position: how many drafts were proposed
    accepted: list  # per draft position: how many were accepted, chained

    @property
    def tokens_per_s(self) -> float:
        return sum(len(t) for t in self.tokens) / self.seconds


class EngineRollouts:
    """Greedy rollouts in megatron-core's ``DynamicInferenceEngine``, drafting ``k`` tokens with
    the model's MTP layers. The engine is suspended between rollouts (megatron treats every
    forward made while an engine is active as inference)."""

    _ids = iter(range(10**9))

    def __init__(self, model, k: int, args) -> None:
        import types

        from megatron.core.inference.config import InferenceConfig
        from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
        from megatron.core.inference.engines import DynamicInferenceEngine
        from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
            GPTInferenceWrapper,
        )
        from megatron.core.inference.text_generation_controllers.text_generation_controller import (  # noqa: E501
            TextGenerationController,
        )

        self.model, self.k, self.temperature = model, k, args.temperature
        context = DynamicInferenceContext(
            model_config=model.config,
            inference_config=InferenceConfig(
                max_sequence_length=args.prompt_len + args.gen + DEPTH + 8,
                buffer_size_gb=2,
                num_speculative_tokens=k,
                unified_memory_level=0,
            ),
        )
        controller = TextGenerationController(
            inference_wrapped_model=GPTInferenceWrapper(model, context),
            tokenizer=types.SimpleNamespace(vocab_size=args.vocab, detokenize=lambda t: ""),
        )
        self.engine = DynamicInferenceEngine(controller, context)
        self.engine.suspend()

    def __call__(self, prompts, gen: int) -> Rollout:
        import torch
        from megatron.core.inference.sampling_params import SamplingParams

        engine, model = self.engine, self.model
        was_training = model.training
        model.eval()
        if self.temperature > 0:
            params = SamplingParams(
                temperature=self.temperature,
                top_k=0,
                top_p=0.0,
                num_tokens_to_generate=gen,
                termination_id=-1,
            )
        else:
            params = SamplingParams(top_k=1, num_tokens_to_generate=gen, termination_id=-1)
        out: dict[int, list] = {}
        try:
            engine.resume()
            proposed0 = engine._spec_tokens_proposed_per_pos.clone()
            accepted0 = engine._spec_tokens_accepted_per_pos.clone()
            with torch.no_grad():
                torch.cuda.synchronize()
                start = time.perf_counter()
                order = []
                for prompt in prompts:
                    rid = next(self._ids)
                    order.append(rid)
                    engine.add_request(rid, prompt.cuda(), params)
                steps = 0
                while engine.has_unfinished_requests():
                    result = engine.step_modern()
                    steps += 1
                    for record in result["finished_request_records"]:
                        request = record.merge()
                        out[request.request_id] = list(request.generated_tokens)
                torch.cuda.synchronize()
                seconds = time.perf_counter() - start
            drafts = (engine._spec_tokens_proposed_per_pos - proposed0).tolist()
            accepted = (engine._spec_tokens_accepted_per_pos - accepted0).tolist()
        finally:
            engine.suspend()
            model.train(was_training)
        return Rollout([out[r] for r in order], seconds, steps, drafts, accepted)


class PlainRollouts:
    """Rollouts as plain forward loops, without speculation: the CPU stand-in for the engine in
    smoke runs (greedy, or sampled at ``--temperature`` from a generator seeded by the prompts,
    so every arm draws alike from the same model)."""

    def __init__(self, model, k: int, args) -> None:
        self.model, self.k, self.device = model, k, args.device
        self.temperature, self.seed = args.temperature, args.seed

    def __call__(self, prompts, gen: int) -> Rollout:
        import torch

        model, was_training = self.model, self.model.training
        model.eval()
        start = time.perf_counter()
        key = sum((i + 1) * int(t) for p in prompts for i, t in enumerate(p.tolist()))
        draw = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + key)
        with torch.no_grad():
            ids = torch.stack(prompts).to(self.device)
            for _ in range(gen):
                pos = torch.arange(ids.shape[1], device=self.device).unsqueeze(0)
                logits = model(ids, pos.expand_as(ids), None)[:, -1].float()
                if self.temperature > 0:
                    probs = torch.softmax(logits / self.temperature, dim=-1)
                    token = torch.multinomial(probs, 1, generator=draw)
                else:
                    token = logits.argmax(-1, keepdim=True)
                ids = torch.cat([ids, token], dim=1)
        model.train(was_training)
        seconds = time.perf_counter() - start
        tokens = [row[-gen:].tolist() for row in ids]
        return Rollout(tokens, seconds, gen, [0] * self.k, [0] * self.k)


def teacher_forced(model, handle, prompts, rollout: Rollout, device: str):
    """The ``+metrics`` of a log-prob forward over prompts + generated tokens, counting only
    the positions whose next token was generated (as the engine drafts only there)."""
    import torch

    import mtp_hooks

    ids = torch.stack(
        [torch.cat([p, torch.tensor(t)]) for p, t in zip(prompts, rollout.tokens, strict=True)]
    )
    ids = ids.to(device)
    pos = torch.arange(ids.shape[1], device=device).unsqueeze(0).expand_as(ids)
    labels = torch.roll(ids, -1, dims=1)
    mask = torch.zeros_like(ids, dtype=torch.float32)
    mask[:, prompts[0].numel() - 1 : -1] = 1
    handle.metrics(reset=True)
    was_training = model.training
    model.eval()
    with torch.no_grad(), mtp_hooks.phase("logprob"):
        model(ids, pos, None, labels=labels, loss_mask=mask)
    model.train(was_training)
    return handle.metrics(reset=True)["logprob"]


def measure(model, handle, engines: dict, prompts, args, batch1: bool = False) -> dict:
    """Rollouts drafting 0..DEPTH tokens on ``prompts``, and the teacher-forced figures."""
    from mtp_hooks.framework import acceptance_from_counts

    row: dict = {"engine": {}}
    for k, engine in engines.items():
        r = engine(prompts, args.gen)
        row["engine"][k] = {
            "tokens_per_s": r.tokens_per_s,
            "steps": r.steps,
            "seconds": r.seconds,
            "drafts": r.drafts,
            "accepted": r.accepted,
        }
        if k and r.drafts[0]:
            m = acceptance_from_counts(r.drafts, r.accepted)
            row["engine"][k].update(
                chain_acceptance=list(m.chain_acceptance), accepted_length=m.accepted_length
            )
        if k == 0:
            tf = teacher_forced(model, handle, prompts, r, args.device)
            row["teacher_forced"] = {
                "chain_acceptance": list(tf.chain_acceptance),
                "accepted_length": tf.accepted_length,
                "acceptance": list(tf.acceptance),
                "loss": list(tf.loss),
                "sampled_chain_acceptance": list(tf.sampled_chain_acceptance),
                "sampled_accepted_length": tf.sampled_accepted_length,
            }
            row["tokens_k0"] = r.tokens
        if batch1:
            one = engine(prompts[:1], args.gen)
            row["engine"][k]["batch1_tokens_per_s"] = one.tokens_per_s
    return row


def prompts_at(lang: PhraseLanguage, args, index: int) -> list:
    rows = lang.sample(args.prompts, args.prompt_len, (args.seed, 7, index))
    return list(rows)


# -- the experiment -------------------------------------------------------------------------------
def run(args, save=lambda results: None) -> dict:
    import torch

    import mtp_hooks
    from mtp_hooks.demo import tiny_models
    from mtp_hooks.framework import (
        AcceptanceController,
        acceptance_from_counts,
        recommend_num_speculative_tokens,
    )

    os.environ["MTP_HOOKS_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    tiny_models.init_single_process()
    tiny_models.reset_mtp_loss_tracker(num_layers=DEPTH, device=args.device)
    model = build_model(args)
    if "mtp_detach_heads" in type(model.config).__dataclass_fields__:  # C and D detach
        mtp_hooks.clip_mtp_apart(model)
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
    out = {"step": row.get("step"), "tf_len": round(row["teacher_forced"]["accepted_length"], 3)}
    for k, e in row["engine"].items():
        out[f"k{k}_tok_s"] = round(e["tokens_per_s"], 1)
        if "accepted_length" in e:
            out[f"k{k}_len"] = round(e["accepted_length"], 3)
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

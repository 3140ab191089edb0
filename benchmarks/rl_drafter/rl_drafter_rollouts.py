"""The RL drafter benchmark's rollouts and measurements: megatron-core's
``DynamicInferenceEngine`` drafting ``k`` tokens with the model's MTP layers (greedy, or sampled
at ``--temperature``), a plain forward loop as its CPU stand-in, and the teacher-forced
``+metrics`` of a log-prob forward over the same rollouts."""

from __future__ import annotations

import time
from dataclasses import dataclass

from rl_drafter_training import DEPTH


@dataclass
class Rollout:
    """What one batch of rollouts gave."""

    tokens: list  # generated tokens per prompt
    seconds: float
    steps: int
    drafts: list  # per draft position: how many drafts were proposed
    accepted: list  # per draft position: how many were accepted, chained

    @property
    def tokens_per_s(self) -> float:
        return sum(len(t) for t in self.tokens) / self.seconds


class EngineRollouts:
    """Rollouts in megatron-core's ``DynamicInferenceEngine``, drafting ``k`` tokens with the
    model's MTP layers: greedy (``top_k=1``), or sampled at ``--temperature``, where the engine
    samples the drafts too and accepts one only when it equals the sampled token. The engine is
    suspended between rollouts (megatron treats every forward made while an engine is active
    as inference)."""

    _ids = iter(range(10**9))

    def __init__(self, model, k: int, args) -> None:
        import types

        from megatron.core.inference.config import InferenceConfig, MambaInferenceStateConfig
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
                # a hybrid's Mamba layers keep a conv and an SSM state per request (None: none)
                mamba_inference_state_config=MambaInferenceStateConfig.from_model(model),
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
    from mtp_hooks_drafting import acceptance_from_counts

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
                # the same walks over drafts computed as megatron's engine computes them,
                # each position alone: what the engine accepts one request at a time
                "single_position_accepted_length": tf.single_position_accepted_length,
                "single_position_sampled_accepted_length": (
                    tf.single_position_sampled_accepted_length
                ),
            }
            row["tokens_k0"] = r.tokens
        if batch1:
            one = engine(prompts[:1], args.gen)
            row["engine"][k]["batch1_tokens_per_s"] = one.tokens_per_s
        if k == max(engines) and k and r.drafts[0]:
            # The same prompts again, one request at a time: megatron's engine runs each MTP
            # depth over its active requests as one sequence, so a request's drafts depend on
            # the requests batched before it, except when it runs alone.
            alone = [engine([p], args.gen) for p in prompts]
            drafts = [sum(c) for c in zip(*(a.drafts for a in alone), strict=True)]
            accepted = [sum(c) for c in zip(*(a.accepted for a in alone), strict=True)]
            if drafts[0]:
                m = acceptance_from_counts(drafts, accepted)
                row["engine"][k]["alone_accepted_length"] = m.accepted_length
    return row

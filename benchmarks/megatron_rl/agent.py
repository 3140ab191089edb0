"""The task as a Megatron-LM RL environment: a ``RewardOnlyAgent`` with procedural prompts.

Megatron-LM builds its agents from an allowlist (``megatron/rl/agent/registry.py``); the
launcher adds this class there as ``MTPCountAgent`` before it runs ``train_rl.py``. The
environment config then names it::

    - agent_type: MTPCountAgent
      agent_args: {seed: 1}
      weight: 1.0

Prompts come in a fixed order from ``seed`` (the n-th call gets :func:`task.problem` ``(seed,
n)``), so every arm of the benchmark sees the same prompts in the same order. Each reward is
also handed to :mod:`steps`, which files it under the step it belongs to.

**Cut at the first end token.** megatron-core's engine (0.19.0, and Megatron-LM main at the
pinned commit) ends a request only when the token it samples is the end token; an end token
among the *accepted draft tokens* does not end it, and the tokens sampled after it are kept.
``train_rl.py`` then stops on its own check, "Only one eod per trajectory in generated tokens".
The agent therefore cuts each trajectory after its first generated end token (and its
log-probs with it), which is what the engine returns when it ends the request there, and
reports the tokens it cut to :mod:`steps`, so every run says how often it happened.

**No length cap.** ``train_rl.py`` asks for up to ``--inference-max-seq-length`` tokens, and
the chat client of ``megatron.rl.inference.megatron`` sends no ``max_tokens`` to the engine
at all, so an agent cannot cap its requests through ``generation_args``: a request runs until
it samples the end token or fills the engine's sequence length. A request that runs on after
an accepted end token can therefore reach that length, and there, with drafting, the engine
asserts (docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any

import steps
from megatron.rl.agent.reward_only_agent import RewardOnlyAgent
from pydantic import PrivateAttr
from task import EOS, answer_numbers, problem, reward, vocabulary

END = vocabulary().index(EOS)  # the tokenizer's ids are the vocabulary's order


def cut_after_end(tokens: list[int], generated: list[bool], logprobs: list[float] | None) -> int:
    """Cuts ``tokens``, ``generated`` and ``logprobs`` (one per generated token), in place,
    after the first generated end token; returns how many tokens it removed."""
    ends = [
        i
        for i, (token, new) in enumerate(zip(tokens, generated, strict=True))
        if new and token == END
    ]
    if not ends:
        return 0
    keep = ends[0] + 1
    removed = len(tokens) - keep
    del tokens[keep:], generated[keep:]
    if logprobs is not None and removed:
        del logprobs[len(logprobs) - removed :]
    return removed


class CountAgent(RewardOnlyAgent):
    """Count on from a history of numbers; the reward pays for every step of two."""

    env_id: str = "count_by_two"
    seed: int = 1
    _drawn: int = PrivateAttr(0)

    def _golden(self, index: int, validation: bool) -> tuple[str, dict[str, Any]]:
        # Validation prompts come from their own stream, so evaluation never moves training's.
        example = problem(self.seed + (10**6 if validation else 0), index)
        return example.prompt, {"problem_id": example.problem_id, "last": example.last}

    async def get_prompt(self, validation: bool = False) -> tuple[str, dict[str, Any]]:
        index, self._drawn = self._drawn, self._drawn + 1
        return self._golden(index, validation)

    async def evaluation_prompts(
        self, num_prompts: int, validation: bool = False
    ) -> list[tuple[str, dict[str, Any]]]:
        return [self._golden(i, True) for i in range(num_prompts)]

    async def get_reward(self, response: str, golden: dict[str, Any], finish_reason: str) -> float:
        return reward(response, golden["last"])

    async def _rollout_from_episode(self, request: Any, episode: Any, golden: Any) -> Any:
        rollout = await super()._rollout_from_episode(request, episode, golden)
        cut = kept = 0
        masks = getattr(rollout, "generation_mask", None)  # token rollouts have one
        if masks is not None:
            for turn, (tokens, generated) in enumerate(zip(rollout.trajectory, masks, strict=True)):
                logprobs = rollout.logprobs[turn] if rollout.logprobs is not None else None
                cut += cut_after_end(tokens, generated, logprobs)
                kept += sum(generated)
        else:  # text rollouts: the reward's own reading of the response
            kept = len(answer_numbers(episode.responses[-1].response.content)) + 1
        steps.note_rollout(float(rollout.reward), kept, cut)
        return rollout

"""The task as a Megatron-LM RL environment: a ``RewardOnlyAgent`` with procedural prompts.

Megatron-LM builds its agents from an allowlist (``megatron/rl/agent/registry.py``); the
launcher adds this class there as ``MTPCopyShiftAgent`` before it runs ``train_rl.py``. The
environment config then names it::

    - agent_type: MTPCopyShiftAgent
      agent_args: {seed: 1}
      weight: 1.0

Prompts come in a fixed order from ``seed`` (the n-th call gets :func:`task.problem` ``(seed,
n)``), so every arm of the benchmark sees the same prompts in the same order. Each reward is
also handed to :mod:`steps`, which files it under the step it belongs to.
"""

from __future__ import annotations

from typing import Any

import steps
from megatron.rl.agent.reward_only_agent import RewardOnlyAgent
from pydantic import PrivateAttr
from task import LONGEST, answer_numbers, problem, reward

# The longest answer is LONGEST numbers and the end token; a few more tokens let a wrong answer
# run long (and cost reward) without ever filling the engine's sequence length.
MAX_TOKENS = LONGEST + 8


class CopyShiftAgent(RewardOnlyAgent):
    """Copy a list of numbers; the reward pays for every number moved one up."""

    env_id: str = "copy_shift"
    seed: int = 1
    _drawn: int = PrivateAttr(0)

    def _golden(self, index: int, validation: bool) -> tuple[str, dict[str, Any]]:
        # Validation prompts come from their own stream, so evaluation never moves training's.
        example = problem(self.seed + (10**6 if validation else 0), index)
        return example.prompt, {"problem_id": example.problem_id, "target": list(example.target)}

    async def get_prompt(self, validation: bool = False) -> tuple[str, dict[str, Any]]:
        index, self._drawn = self._drawn, self._drawn + 1
        return self._golden(index, validation)

    async def evaluation_prompts(
        self, num_prompts: int, validation: bool = False
    ) -> list[tuple[str, dict[str, Any]]]:
        return [self._golden(i, True) for i in range(num_prompts)]

    async def _run_episode(self, request: Any, **kwargs: Any) -> Any:
        # megatron asks for up to --inference-max-seq-length tokens; this task's answers are
        # short, so the agent caps its own requests (an agent's choice, not megatron's code).
        generation = request.generation_args
        cap = min(generation.max_tokens or MAX_TOKENS, MAX_TOKENS)
        generation = generation.model_copy(update={"max_tokens": cap})
        request = request.model_copy(update={"generation_args": generation})
        return await super()._run_episode(request, **kwargs)

    async def get_reward(self, response: str, golden: dict[str, Any], finish_reason: str) -> float:
        value = reward(response, golden["target"])
        steps.note_rollout(value, len(answer_numbers(response)) + 1)
        return value

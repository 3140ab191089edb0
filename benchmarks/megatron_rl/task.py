"""The benchmark's task, made up on the spot: copy a list of numbers, and RL rewards a shift.

A prompt is ``copy 17 4 199 ... =``; an answer holds one number per number of the prompt, then
the end token. Pretraining (:func:`pretraining_document`) answers with each number kept, or with
probability ``shift`` moved one up (``199`` wraps to ``0``), each position on its own. The RL
reward (:func:`reward`) is the fraction of answer positions that hold the moved number. So the
pretrained policy starts near ``shift``, can climb to 1 by sampling, and its next-token
distributions move as it climbs: a drafter that is not trained on the way keeps drafting the
kept number the pretraining data favoured.

Nothing here needs torch or megatron: prompts, rewards and the corpus are plain Python, and the
same seed gives the same prompts in every arm.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

NUMBERS = 200  # the numbers 0..199, one token each
COMMAND, SEPARATOR = "copy", "="
UNK, PAD, BOS, EOS = "<unk>", "<pad>", "<bos>", "<eos>"
SPECIALS = (UNK, PAD, BOS, EOS)  # ids 0..3: pad is 1 and eos 3 (megatron's RL pads with pad)
SHORTEST, LONGEST = 16, 48  # numbers per prompt: the answers are 17 to 49 tokens long


def vocabulary() -> list[str]:
    """Every token, in id order: the specials, the command, the separator, then the numbers."""
    return [*SPECIALS, COMMAND, SEPARATOR, *(str(n) for n in range(NUMBERS))]


@dataclass(frozen=True)
class Problem:
    """One prompt: its id (a string, as megatron's rollout records require) and its numbers."""

    problem_id: str
    numbers: tuple[int, ...]

    @property
    def prompt(self) -> str:
        """The prompt text, ending with the separator."""
        return " ".join((COMMAND, *map(str, self.numbers), SEPARATOR))

    @property
    def target(self) -> tuple[int, ...]:
        """The answer the RL reward pays for: every number moved one up."""
        return tuple((n + 1) % NUMBERS for n in self.numbers)


def problem(seed: int, index: int) -> Problem:
    """The ``index``-th prompt of ``seed``: the same in every process and every arm."""
    rng = random.Random(f"megatron-rl-copy:{seed}:{index}")
    count = rng.randint(SHORTEST, LONGEST)
    return Problem(f"{seed}-{index}", tuple(rng.randrange(NUMBERS) for _ in range(count)))


def answer_numbers(response: str) -> list[int]:
    """The numbers of a detokenized response, up to its end token; other tokens count as -1."""
    numbers = []
    for word in response.split():
        if word == EOS:
            break
        numbers.append(int(word) if word.isdigit() and int(word) < NUMBERS else -1)
    return numbers


def reward(response: str, target: tuple[int, ...] | list[int]) -> float:
    """The fraction of answer positions holding the target number, over the longer of the two.

    Missing numbers and extra ones both cost: ``max(len(answer), len(target))`` divides.
    """
    answer = answer_numbers(response)
    if not target:
        return 0.0
    hits = sum(a == t for a, t in zip(answer, target, strict=False))
    return hits / max(len(answer), len(target))


def pretraining_document(rng: random.Random, shift: float) -> str:
    """One pretraining document: a prompt and an answer, each number moved up with ``shift``.

    The end token is not part of the text: the corpus writer appends the tokenizer's end id.
    """
    if not 0.0 <= shift <= 1.0:
        raise ValueError(f"shift must be a probability in [0, 1], got {shift!r}")
    example = problem(rng.randrange(2**31), 0)
    answer = [(n + 1) % NUMBERS if rng.random() < shift else n for n in example.numbers]
    return " ".join((example.prompt, *map(str, answer)))

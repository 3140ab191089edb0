"""The benchmark's task, made up on the spot: count on from a list of numbers, in steps of two.

A prompt is ``count 17 18 20 21 =``: a history of numbers, each one or two above the one
before (modulo :data:`NUMBERS`). An answer continues the count for :data:`ANSWER_LENGTH`
numbers, then the end token. Pretraining (:func:`pretraining_document`) steps by two with
probability ``shift`` and by one otherwise, in the history and in the answer alike. The RL
reward (:func:`reward`) pays for each answer number that is two above the number before it.

So the pretrained policy starts near ``shift``, can climb to 1 by sampling, and its next-token
distributions move as it climbs, from mostly +1 to +2. A drafter that is not trained on the way
keeps drafting the +1 the pretraining data favoured. The prompts keep pretraining's mixture
while the responses move, so an MTP loss on the whole sequence and one on the response only
learn different things.

The rule is local (the next number depends on the one before it), so a small model learns it
in a few hundred pretraining iterations: a copy task needs induction heads, which a
benchmark-sized pretraining run did not form.

Nothing here needs torch or megatron: prompts, rewards and the corpus are plain Python, and the
same seed gives the same prompts in every arm.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

NUMBERS = 200  # the numbers 0..199, one token each
COMMAND, SEPARATOR = "count", "="
UNK, PAD, BOS, EOS = "<unk>", "<pad>", "<bos>", "<eos>"
SPECIALS = (UNK, PAD, BOS, EOS)  # ids 0..3: pad is 1 and eos 3 (megatron's RL pads with pad)
SHORTEST, LONGEST = 8, 24  # numbers in a prompt's history
ANSWER_LENGTH = 32  # numbers in an answer, before the end token
STEP = 2  # the step the reward pays for; pretraining's other step is 1


def vocabulary() -> list[str]:
    """Every token, in id order: the specials, the command, the separator, then the numbers."""
    return [*SPECIALS, COMMAND, SEPARATOR, *(str(n) for n in range(NUMBERS))]


def count_on(rng: random.Random, start: int, length: int, shift: float) -> list[int]:
    """``length`` numbers after ``start``, each ``STEP`` above the one before with probability
    ``shift`` and one above otherwise."""
    numbers, last = [], start
    for _ in range(length):
        last = (last + (STEP if rng.random() < shift else 1)) % NUMBERS
        numbers.append(last)
    return numbers


@dataclass(frozen=True)
class Problem:
    """One prompt: its id (a string, as megatron's rollout records require) and its history."""

    problem_id: str
    numbers: tuple[int, ...]

    @property
    def prompt(self) -> str:
        """The prompt text, ending with the separator."""
        return " ".join((COMMAND, *map(str, self.numbers), SEPARATOR))

    @property
    def last(self) -> int:
        """The number the answer counts on from."""
        return self.numbers[-1]

    @property
    def target(self) -> tuple[int, ...]:
        """The answer that earns the full reward: ``ANSWER_LENGTH`` steps of ``STEP``."""
        return tuple((self.last + STEP * (i + 1)) % NUMBERS for i in range(ANSWER_LENGTH))


def problem(seed: int, index: int, shift: float = 0.3) -> Problem:
    """The ``index``-th prompt of ``seed``: the same in every process and every arm. Its
    history follows pretraining's mixture of steps."""
    rng = random.Random(f"megatron-rl-count:{seed}:{index}")
    length = rng.randint(SHORTEST, LONGEST)
    start = rng.randrange(NUMBERS)
    return Problem(f"{seed}-{index}", (start, *count_on(rng, start, length - 1, shift)))


def answer_numbers(response: str) -> list[int]:
    """The numbers of a detokenized response, up to its end token; other tokens count as -1."""
    numbers = []
    for word in response.split():
        if word == EOS:
            break
        numbers.append(int(word) if word.isdigit() and int(word) < NUMBERS else -1)
    return numbers


def reward(response: str, last: int) -> float:
    """The fraction of answer numbers that are ``STEP`` above the number before them (the
    first one: above ``last``, the prompt's final number), over ``max(len(answer),
    ANSWER_LENGTH)``: a short answer and a long one both cost."""
    answer = answer_numbers(response)
    before = [last, *answer][: len(answer)]
    hits = sum(b >= 0 and a == (b + STEP) % NUMBERS for b, a in zip(before, answer, strict=True))
    return hits / max(len(answer), ANSWER_LENGTH)


def pretraining_document(rng: random.Random, shift: float) -> str:
    """One pretraining document: a prompt and its answer, both stepping by ``STEP`` with
    probability ``shift``.

    The end token is not part of the text: the corpus writer appends the tokenizer's end id.
    """
    if not 0.0 <= shift <= 1.0:
        raise ValueError(f"shift must be a probability in [0, 1], got {shift!r}")
    example = problem(rng.randrange(2**31), 0, shift)
    answer = count_on(rng, example.last, ANSWER_LENGTH, shift)
    return " ".join((example.prompt, *map(str, answer)))

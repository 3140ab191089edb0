"""The RL drafter benchmark's language: a bank of random phrases joined by a Markov chain over
phrases, its RL-shaped batches (prompt, response, padding) and the prompts the rollouts start
from. Every sample is a pure function of its seed, so every arm sees the same data."""

from __future__ import annotations

from dataclasses import dataclass

PAD = 0  # the phrase banks draw tokens from 1 on, so padding is a token of its own


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


def prompts_at(lang: PhraseLanguage, args, index: int) -> list:
    rows = lang.sample(args.prompts, args.prompt_len, (args.seed, 7, index))
    return list(rows)

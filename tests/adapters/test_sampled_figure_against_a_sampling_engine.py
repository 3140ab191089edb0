"""``+metrics``' sampled accepted length against an engine that drafts and verifies by sampling.

megatron's inference engine needs CUDA, so this is a faithful small stand-in for the algorithm
it runs, on a real trained GPTModel with two MTP depths: after each verify step, sample depth
1's draft from its distribution given the last hidden state and the token just sampled, depth
2's given that draft, then sample the policy's tokens at the drafted positions and accept each
draft only while it equals them, plus the policy's next token after the last one accepted. Every
distribution comes from a full forward of the model over the sequence so far (causal, so right
padding changes nothing), read where megatron reads it.

The corpus alternates stretches a model learns (one of four fixed phrases) with stretches it
cannot (uniform noise). An engine accepts whole chains in the phrases and jumps over them, so
it verifies in the noise far more often than a mean over positions assumes. The figure must
follow the engine there; the per-position mean reads about half again too high. Over four
seeds the figure read 5-7% above this engine: it takes a chain's depths as independent given
the data, while an engine's second draft follows a first one it accepted. Hence 12%.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

import mtp_hooks  # noqa: E402
from mtp_hooks.demo import tiny_models  # noqa: E402

VOCAB, PHRASES, PHRASE, NOISE, SEQ = 32, 4, 10, 5, 48
PROMPT, GENERATED, ROLLOUTS, STEPS = 8, 40, 32, 200


def corpus(n: int, generator: torch.Generator, phrases: torch.Tensor) -> torch.Tensor:
    blocks = SEQ // (PHRASE + NOISE) + 1
    which = torch.randint(0, PHRASES, (n, blocks), generator=generator)
    noise = torch.randint(0, VOCAB, (n, blocks, NOISE), generator=generator)
    return torch.cat([phrases[which], noise], dim=-1).reshape(n, -1)[:, :SEQ]


def trained_model(generator: torch.Generator, phrases: torch.Tensor) -> torch.nn.Module:
    spec = tiny_models.TinySpec(
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        vocab_size=VOCAB,
        seq_length=64,
        mtp_num_layers=2,
    )
    torch.manual_seed(0)
    model = tiny_models.build_gpt(spec, attention="sdpa", mtp_loss_scaling_factor=1.0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    positions = torch.arange(SEQ).unsqueeze(0).expand(16, -1)
    for _ in range(STEPS):
        ids = corpus(16, generator, phrases)
        loss = model(ids, positions, None, labels=torch.roll(ids, -1, 1)).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


class Distributions:
    """The policy's and each MTP depth's next-token distributions over right-padded rows."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.weight = model.output_layer.weight.detach()
        self.hidden: list[torch.Tensor] = []
        model.mtp.register_forward_hook(lambda m, a, out: self.hidden.append(out.detach()))

    def __call__(self, rows: list[list[int]]) -> list[torch.Tensor]:
        """``[policy, depth 1, depth 2]``, each ``[rows, length, vocab]`` in float64."""
        length = max(len(r) for r in rows)
        ids = torch.tensor([r + [0] * (length - len(r)) for r in rows])
        positions = torch.arange(length).unsqueeze(0).expand_as(ids)
        self.hidden.clear()
        with torch.no_grad():
            self.model(ids, positions, None, labels=torch.roll(ids, -1, 1))
        chunks = torch.chunk(self.hidden[0], 3, dim=0)  # [length, rows, hidden] each
        return [torch.softmax((c @ self.weight.t()).double(), -1).transpose(0, 1) for c in chunks]


def draw(probs: torch.Tensor, generator: torch.Generator) -> list[int]:
    return torch.multinomial(probs, 1, generator=generator).squeeze(1).tolist()


def speculative_sampling(dist: Distributions, prompts: list[list[int]], g: torch.Generator):
    """Accepted drafts per verify step of a k=2 engine that samples drafts and tokens."""
    rows = [list(p) for p in prompts]
    first = dist(rows)[0][:, PROMPT - 1]
    for row, token in zip(rows, draw(first, g), strict=True):
        row.append(token)
    accepted = steps = 0
    while live := [i for i, r in enumerate(rows) if len(r) - PROMPT < GENERATED]:
        here = [len(rows[i]) - 2 for i in live]  # the hidden state the drafts start from
        picks = torch.arange(len(live))
        q1 = dist([rows[i] for i in live])[1][picks, here]
        one = draw(q1, g)
        q2 = dist([rows[i] + [d] for i, d in zip(live, one, strict=True)])[2][picks, here]
        two = draw(q2, g)
        policy = dist([rows[i] + [a, b] for i, a, b in zip(live, one, two, strict=True)])[0]
        targets = [
            draw(policy[picks, [t + step for t in here]], g) for step in (1, 2, 3)
        ]  # the policy's own tokens at the drafted positions, and after them
        for n, i in enumerate(live):
            new = [targets[0][n]]
            if targets[0][n] == one[n]:
                new = [one[n], targets[1][n]]
                if targets[1][n] == two[n]:
                    new = [one[n], two[n], targets[2][n]]
            accepted, steps = accepted + len(new) - 1, steps + 1
            rows[i] += new
    return accepted / steps


def test_the_sampled_accepted_length_follows_a_sampling_engine_where_the_mean_reads_high():
    tiny_models.init_single_process()
    tiny_models.reset_mtp_loss_tracker(num_layers=2)
    g = torch.Generator().manual_seed(1)
    phrases = torch.randint(0, VOCAB, (PHRASES, PHRASE), generator=g)
    model = trained_model(g, phrases)
    dist = Distributions(model)
    prompts = corpus(ROLLOUTS, g, phrases)[:, :PROMPT].tolist()
    engine = speculative_sampling(dist, prompts, g)

    rows = [list(p) for p in prompts]  # rollouts without drafts, for the teacher-forced figure
    for _ in range(GENERATED):
        for row, token in zip(rows, draw(dist(rows)[0][:, -1], g), strict=True):
            row.append(token)
    ids = torch.tensor(rows)
    mask = torch.zeros_like(ids, dtype=torch.float32)
    mask[:, PROMPT - 1 : -1] = 1  # the positions whose next token was generated
    mtp_hooks.declare_phase("logprob")
    mtp_hooks.configure("logprob=run+metrics")
    handle = mtp_hooks.attach(model)
    positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    with torch.no_grad(), mtp_hooks.phase("logprob"):
        model(ids, positions, None, labels=torch.roll(ids, -1, 1), loss_mask=mask)
    figures = handle.metrics()["logprob"]
    walk, mean = figures.sampled_accepted_length, sum(figures.sampled_chain_acceptance)
    print(f"engine {engine:.3f}, walk {walk:.3f}, mean over positions {mean:.3f}")
    assert walk == pytest.approx(engine, rel=0.12)
    assert mean > 1.25 * engine  # the corpus tells the two apart

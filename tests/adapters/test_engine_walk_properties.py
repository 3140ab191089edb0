"""The engine's walk over teacher-forced chains, against plain loops, on generated rows:
hypothesis, 300 examples with a fixed seed. The greedy walk is what
``MTPMetrics.accepted_length`` reports, and the expected walk of a sampling engine what
``sampled_accepted_length`` reports, so a teacher-forced figure reads as the engine's accepted
tokens per verify step."""

from __future__ import annotations

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mtp_hooks.megatron._engine_walk import engine_walk, expected_walk  # noqa: E402

SETTINGS = settings(max_examples=300, derandomize=True, database=None, deadline=None)


@st.composite
def chains(draw):
    """``[b, s]`` rows of chain lengths (0..depth, never past the row or its region) and
    regions (runs of positions the engine drafts from)."""
    batch, seq, depth = draw(st.integers(1, 3)), draw(st.integers(0, 40)), draw(st.integers(1, 3))
    region = [[draw(st.booleans()) for _ in range(seq)] for _ in range(batch)]
    run = []
    for row in region:
        lengths = []
        for i in range(seq):
            room = 0  # a chain accepts only positions the region still has after i
            while room < depth and i + room + 1 < seq and row[i + room + 1]:
                room += 1
            lengths.append(draw(st.integers(0, room)) if row[i] else 0)
        run.append(lengths)
    return torch.tensor(run, dtype=torch.long).reshape(batch, seq), torch.tensor(
        region, dtype=torch.bool
    ).reshape(batch, seq)


def walked(run: torch.Tensor, region: torch.Tensor) -> tuple[int, int]:
    accepted = steps = 0
    for lengths, row in zip(run.tolist(), region.tolist(), strict=True):
        for start, inside in enumerate(row):
            if inside and (start == 0 or not row[start - 1]):
                i = start
                while i < len(row) and row[i]:
                    accepted, steps = accepted + lengths[i], steps + 1
                    i += lengths[i] + 1
    return accepted, steps


@SETTINGS
@given(chains())
def test_the_engine_walk_equals_a_plain_loop_over_every_region(case):
    run, region = case
    accepted, steps = engine_walk(run, region)
    assert (int(accepted), int(steps)) == walked(run, region)


def test_a_walk_skips_the_positions_a_chain_accepted():
    run = torch.tensor([[2, 2, 2, 0, 0, 0]])
    region = torch.ones_like(run, dtype=torch.bool)
    # verify at 0 (accepts 2), then 3, 4, 5: 2 accepted in 4 steps, not 6 in 6 positions
    assert tuple(int(x) for x in engine_walk(run, region)) == (2, 4)


@st.composite
def chances(draw):
    """``[b, s, depth]`` chances that a chain from each position accepts depths ``1..d``
    (falling with ``d``, zero past the row or its region), and the regions."""
    batch, seq, depth = draw(st.integers(1, 3)), draw(st.integers(0, 30)), draw(st.integers(1, 3))
    region = [[draw(st.booleans()) for _ in range(seq)] for _ in range(batch)]
    chain = torch.zeros(batch, seq, depth, dtype=torch.float64)
    for b, row in enumerate(region):
        for i in range(seq):
            reach = 1.0
            for d in range(depth):
                if not row[i] or i + d + 1 >= seq or not row[i + d + 1]:
                    break
                reach *= draw(st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]))
                chain[b, i, d] = reach
    return chain, torch.tensor(region, dtype=torch.bool).reshape(batch, seq)


def walked_in_expectation(chain: torch.Tensor, region: torch.Tensor) -> tuple[float, float]:
    accepted = steps = 0.0
    depth = chain.shape[-1]
    for reach_rows, row in zip(chain.tolist(), region.tolist(), strict=True):
        visit = [0.0] * len(row)
        for i, inside in enumerate(row):
            if not inside:
                continue
            visit[i] += 1.0 if i == 0 or not row[i - 1] else 0.0
            reach = [1.0, *reach_rows[i], 0.0]
            for n in range(depth + 1):
                j = i + n + 1
                if j < len(row) and row[j]:
                    visit[j] += visit[i] * (reach[n] - reach[n + 1])
            accepted += visit[i] * sum(reach_rows[i])
            steps += visit[i]
    return accepted, steps


@SETTINGS
@given(chances())
def test_the_expected_walk_equals_a_plain_loop_over_every_region(case):
    chain, region = case
    accepted, steps = expected_walk(chain, region)
    want_accepted, want_steps = walked_in_expectation(chain, region)
    assert float(accepted) == pytest.approx(want_accepted, abs=1e-4)
    assert float(steps) == pytest.approx(want_steps, abs=1e-4)


@SETTINGS
@given(chains())
def test_with_certain_chances_the_expected_walk_is_the_greedy_walk(case):
    run, region = case
    depth = max(1, int(run.max()) if run.numel() else 1)
    certain = torch.stack([(run > d).double() for d in range(depth)], dim=-1)
    assert tuple(float(x) for x in expected_walk(certain, region)) == tuple(
        float(x) for x in engine_walk(run, region)
    )


def test_the_expected_walk_is_the_mean_of_walks_sampled_as_an_engine_samples():
    """An easy stretch and a hard one: a sampling engine jumps over the easy one, so it verifies
    more often where drafts fail, and accepts fewer per verify step than the mean over positions."""
    generator = torch.Generator().manual_seed(7)
    seq, depth = 24, 2
    first = torch.tensor([0.9] * 12 + [0.2] * 12, dtype=torch.float64)
    chain = torch.zeros(1, seq, depth, dtype=torch.float64)
    chain[0, :-1, 0] = first[:-1]
    chain[0, :-2, 1] = first[:-2] * first[1:-1]
    region = torch.ones(1, seq, dtype=torch.bool)
    accepted, steps = (float(x) for x in expected_walk(chain, region))
    total_accepted = total_steps = 0
    for _ in range(4000):
        i = 0
        while i < seq:
            n = 0
            while n < depth and torch.rand((), generator=generator, dtype=torch.float64) < (
                chain[0, i, n] / (chain[0, i, n - 1] if n else 1.0)
            ):
                n += 1
            total_accepted, total_steps = total_accepted + n, total_steps + 1
            i += n + 1
    assert accepted / steps == pytest.approx(total_accepted / total_steps, rel=0.02)
    assert accepted / steps < float(chain.sum()) / seq  # the mean over positions reads high

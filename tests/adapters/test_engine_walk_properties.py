"""The greedy engine's walk over teacher-forced chains, against a plain loop, on generated
rows: hypothesis, 300 examples with a fixed seed. The walk is what ``MTPMetrics.accepted_length``
reports, so a teacher-forced figure reads as the engine's accepted tokens per verify step."""

from __future__ import annotations

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mtp_hooks.megatron._engine_walk import engine_walk  # noqa: E402

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

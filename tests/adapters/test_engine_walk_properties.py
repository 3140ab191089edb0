"""The engine's walk over teacher-forced chains, against the user guide's walk written as
plain loops, on rows derived from generated loss masks (holes of every width, rows fully
masked, 1 to 64 positions, 1 to 3 depths): hypothesis, 300 examples with a fixed seed. The
greedy walk is what ``MTPMetrics.accepted_length`` reports, and the expected walk of a sampling
engine what ``sampled_accepted_length`` reports, so a teacher-forced figure reads as the
engine's accepted tokens per verify step."""

from __future__ import annotations

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mtp_hooks.megatron.drafting._engine_walk import (  # noqa: E402
    engine_walk,
    expected_walk,
    verify_chances,
)

SETTINGS = settings(max_examples=300, derandomize=True, database=None, deadline=None)


@st.composite
def loss_masks(draw, min_seq: int = 1, max_seq: int = 64):
    """``[b, s]`` loss masks over the labels, with holes of every width and rows fully masked,
    and a depth: what ``+metrics`` derives its regions and chains from."""
    batch, seq, depth = (
        draw(st.integers(1, 3)),
        draw(st.integers(min_seq, max_seq)),
        draw(st.integers(1, 3)),
    )
    rows = []
    for _ in range(batch):
        kind = draw(st.sampled_from(["holes", "holes", "masked", "open"]))
        if kind == "masked":
            rows.append([False] * seq)
        elif kind == "open":
            rows.append([True] * seq)
        else:
            row: list[bool] = []
            while len(row) < seq:  # stretches of labels, then holes of any width
                row += [True] * draw(st.integers(0, 12)) + [False] * draw(st.integers(1, 4))
            rows.append(row[:seq])
    return torch.tensor(rows, dtype=torch.bool).reshape(batch, seq), depth


def depth_valid(mask: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """Per depth ``d`` (0-based), ``[b, s]``: depth ``d`` at position ``i`` has a label, as
    ``+metrics`` rolls the mask (its label is the one ``d + 1`` places on)."""
    out = []
    for d in range(depth):
        shifted = torch.zeros_like(mask)
        shifted[:, : max(0, mask.shape[1] - d - 1)] = mask[:, d + 1 :]
        out.append(shifted)
    return out


@st.composite
def chains(draw, min_seq: int = 1, max_seq: int = 64):
    """``[b, s]`` chain lengths and the region (depth 1 has a label), derived from a loss mask
    and drawn hits as ``+metrics`` derives them: a chain from ``i`` runs while every depth so
    far hits, and may end on a position outside the region (a masked label at ``h`` takes
    ``h - 1`` out of it, while a chain from ``h - 2`` can still reach ``h``)."""
    mask, depth = draw(loss_masks(min_seq, max_seq))
    valid = depth_valid(mask, depth)
    chain = torch.ones_like(mask)
    run = torch.zeros(mask.shape, dtype=torch.long)
    for d in range(depth):
        hits = torch.tensor(
            [[draw(st.booleans()) for _ in range(mask.shape[1])] for _ in range(mask.shape[0])],
            dtype=torch.bool,
        ).reshape(mask.shape)
        chain = chain & hits & valid[d]
        run += chain.long()
    return run, valid[0]


def walked(run: torch.Tensor, region: torch.Tensor) -> tuple[int, int]:
    """The user guide's walk, one row at a time: verify at the first position the engine drafts
    from, accept the chain there, sample one more token, and verify next after those tokens,
    at the first position after them that it drafts from."""
    accepted = steps = 0
    for lengths, row in zip(run.tolist(), region.tolist(), strict=True):
        i = 0
        while i < len(row):
            if not row[i]:
                i += 1
                continue
            accepted, steps = accepted + lengths[i], steps + 1
            i += lengths[i] + 1
    return accepted, steps


@SETTINGS
@given(chains())
def test_the_engine_walk_equals_the_user_guides_walk_over_masks_with_holes(case):
    run, region = case
    accepted, steps = engine_walk(run, region)
    assert (int(accepted), int(steps)) == walked(run, region)


def test_a_chain_over_a_one_position_hole_is_walked_once():
    # position 3 has no label (a masked end-of-document label): the chain from 2 reaches 4,
    # where the walk goes on (verify steps 0, 1, 2, 4, 6); 4 starts no walk of its own
    run = torch.tensor([[0, 0, 1, 0, 1, 0, 0]])
    region = torch.tensor([[True, True, True, False, True, True, True]])
    assert tuple(int(x) for x in engine_walk(run, region)) == walked(run, region) == (2, 5)


def test_a_walk_skips_the_positions_a_chain_accepted():
    run = torch.tensor([[2, 2, 2, 0, 0, 0]])
    region = torch.ones_like(run, dtype=torch.bool)
    # verify at 0 (accepts 2), then 3, 4, 5: 2 accepted in 4 steps, not 6 in 6 positions
    assert tuple(int(x) for x in engine_walk(run, region)) == (2, 4)


@st.composite
def chances(draw, max_seq: int = 64):
    """``[b, s, depth]`` chances that a chain from each position accepts depths ``1..d``, and
    the region, from a loss mask as ``+metrics`` derives them: a depth's chance where it has a
    label, the chain their product while every depth so far has one."""
    mask, depth = draw(loss_masks(1, max_seq))
    valid = depth_valid(mask, depth)
    batch, seq = mask.shape
    chain = torch.zeros(batch, seq, depth, dtype=torch.float64)
    reach = torch.ones(batch, seq, dtype=torch.float64)
    present = torch.ones_like(mask)
    for d in range(depth):
        accept = torch.tensor(
            [draw(st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0])) for _ in range(batch * seq)],
            dtype=torch.float64,
        ).reshape(batch, seq)
        reach = reach * accept
        present = present & valid[d]
        chain[..., d] = reach * present
    return chain, valid[0]


def verify_chances_by_hand(chain: torch.Tensor, region: torch.Tensor) -> list[list[float]]:
    """The user guide's sampling walk in expectation, one position at a time: the walk begins
    at the row's first drafted position; from a verify step at ``i`` it accepts ``n`` drafts
    with the chance of exactly that chain and verifies next at the first drafted position from
    ``i + n + 1`` on."""
    depth = chain.shape[-1]
    out = []
    for reach_rows, row in zip(chain.tolist(), region.tolist(), strict=True):
        arrive = [0.0] * (len(row) + depth + 2)
        arrive[0] = 1.0
        visit = [0.0] * len(row)
        for i, inside in enumerate(row):
            if not inside:  # nothing verifies here: what landed moves on to the next position
                arrive[i + 1] += arrive[i]
                continue
            visit[i] = arrive[i]
            reach = [1.0, *reach_rows[i], 0.0]
            for n in range(depth + 1):
                arrive[i + n + 1] += visit[i] * (reach[n] - reach[n + 1])
        out.append(visit)
    return out


def walked_in_expectation(chain: torch.Tensor, region: torch.Tensor) -> tuple[float, float]:
    visits = verify_chances_by_hand(chain, region)
    accepted = sum(
        v * sum(reach)
        for row_v, rows in zip(visits, chain.tolist(), strict=True)
        for v, reach in zip(row_v, rows, strict=True)
    )
    return accepted, sum(sum(row) for row in visits)


@SETTINGS
@given(chances())
def test_the_expected_walk_equals_the_user_guides_walk_in_expectation(case):
    chain, region = case
    accepted, steps = expected_walk(chain, region)
    want_accepted, want_steps = walked_in_expectation(chain, region)
    assert float(accepted) == pytest.approx(want_accepted, abs=1e-4)
    assert float(steps) == pytest.approx(want_steps, abs=1e-4)


@SETTINGS
@given(chances())
def test_every_verify_chance_of_the_sampling_walk_stays_in_zero_to_one(case):
    chain, region = case
    visits = verify_chances(chain, region)
    assert bool(((visits >= -1e-12) & (visits <= 1 + 1e-9)).all())
    want = torch.tensor(verify_chances_by_hand(chain, region), dtype=torch.float64)
    torch.testing.assert_close(visits, want.reshape(visits.shape), atol=1e-9, rtol=0)


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

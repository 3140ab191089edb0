"""Properties of the speculation helpers on generated input.

hypothesis, 300 examples with a fixed seed per test. Each helper either returns what its
docstring says or raises :class:`mtp_hooks.PolicyError`: never another exception, and never a
result that breaks its contract (chained counts, falling rates, the best ``k``)."""

from __future__ import annotations

import math

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mtp_hooks import MTPMetrics, PolicyError  # noqa: E402
from mtp_hooks_drafting import (  # noqa: E402
    acceptance_from_counts,
    acceptance_from_megatron,
    recommend_num_speculative_tokens,
)

SETTINGS = settings(max_examples=300, derandomize=True, database=None, deadline=None)
# What a caller may pass where a count or a rate belongs, good and bad alike.
counts = st.one_of(
    st.integers(-3, 10**6),
    st.integers(2**62, 2**70),
    st.booleans(),
    st.floats(),
    st.text(max_size=2),
)
rates = st.one_of(st.floats(-10, 110), st.floats(), st.integers(-10, 110), st.booleans(), st.none())


@SETTINGS
@given(
    drafts=st.one_of(counts, st.lists(counts, max_size=4)), accepted=st.lists(counts, max_size=4)
)
def test_acceptance_from_counts_keeps_its_contract_or_raises_a_policy_error(drafts, accepted):
    try:
        m = acceptance_from_counts(drafts, accepted)
    except PolicyError:
        return
    proposed = list(drafts) if isinstance(drafts, list) else [drafts] * len(accepted)
    assert accepted, "no positions must be refused"
    assert all(isinstance(a, int) and not isinstance(a, bool) and a >= 0 for a in accepted)
    assert all(a <= d for a, d in zip(accepted, proposed, strict=False))
    assert all(later <= earlier for earlier, later in zip(accepted, accepted[1:], strict=False))
    assert m.tokens == tuple(proposed) and len(m.chain_acceptance) == len(accepted)
    assert all(0.0 <= c <= 1.0 for c in (*m.chain_acceptance, *m.acceptance))
    assert m.accepted_length == pytest.approx(sum(m.chain_acceptance))
    if not isinstance(drafts, list):  # one draft count for all positions: the chain falls
        chain = m.chain_acceptance
        assert all(later <= earlier for earlier, later in zip(chain, chain[1:], strict=False))


@SETTINGS
@given(
    rates=st.lists(rates, max_size=4),
    proposed=counts,
    prefix=st.sampled_from(["inference/", ""]),
)
def test_acceptance_from_megatron_refuses_rates_that_rise_before_rounding(rates, proposed, prefix):
    metrics = {f"{prefix}spec_decode_acceptance_rate_pos{k + 1}": r for k, r in enumerate(rates)}
    metrics[f"{prefix}spec_decode_tokens_proposed"] = proposed
    try:
        m = acceptance_from_megatron(metrics)
    except PolicyError:
        return
    numbers = [float(r) for r in rates]
    assert rates and all(0.0 <= r <= 100.0 for r in numbers)
    assert all(later <= earlier for earlier, later in zip(numbers, numbers[1:], strict=False))
    assert len(m.chain_acceptance) == len(rates)
    chain = m.chain_acceptance
    assert all(later <= earlier for earlier, later in zip(chain, chain[1:], strict=False))


@SETTINGS
@given(
    chain=st.lists(rates.map(lambda r: r / 100 if isinstance(r, float) else r), max_size=4),
    cost=st.one_of(st.floats(), st.lists(st.floats(), max_size=6), st.text(max_size=2)),
    max_tokens=st.one_of(st.none(), counts),
    floor=st.one_of(st.floats(), st.booleans()),
)
def test_the_recommended_k_is_the_best_documented_speedup_or_a_policy_error(
    chain, cost, max_tokens, floor
):
    try:
        advice = recommend_num_speculative_tokens(
            chain, step_cost=cost, max_tokens=max_tokens, min_speedup=floor
        )
    except PolicyError:
        return
    k = advice.num_speculative_tokens
    speedups = advice.speedups
    assert 0 <= k < len(speedups) and speedups[0] == 1.0
    assert all(math.isfinite(s) and s > 0 for s in speedups)
    best = max(speedups)
    if k == 0:  # no k > 0 beats both drafting nothing and min_speedup
        assert all(s <= 1.0 or s <= floor for s in speedups[1:])
    else:
        assert speedups[k] == best and speedups[k] > floor
        assert all(s < best for s in speedups[:k])  # a tie goes to the smaller k


@SETTINGS
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=4).map(sorted).map(lambda a: a[::-1]))
def test_chained_counts_from_an_engine_always_give_metrics_the_controller_can_use(accepted):
    m = acceptance_from_counts(max(accepted) + 1, accepted)
    assert isinstance(m, MTPMetrics) and 0.0 <= m.accepted_length <= len(accepted)

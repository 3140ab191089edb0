"""Properties of the AcceptanceController and loss_scale_schedule on generated input.

hypothesis, 300 examples with a fixed seed per test: the controlled weight is always one of the
two configured actions, and a schedule gives one of its weights (or one between two,
interpolating) or a ``PolicyError``."""

from __future__ import annotations

import warnings

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mtp_hooks import MTPMetrics, PolicyError  # noqa: E402
from mtp_hooks.framework import loss_scale_schedule  # noqa: E402
from mtp_hooks_drafting import AcceptanceController, DeadDrafterWarning  # noqa: E402

SETTINGS = settings(max_examples=300, derandomize=True, database=None, deadline=None)
anything = st.floats(allow_nan=True, allow_infinity=True)
figures = st.builds(
    lambda length, chain, acc, tokens: MTPMetrics(
        loss=(1.0,) * len(tokens),
        acceptance=tuple(acc[: len(tokens)]) + (0.0,) * (len(tokens) - len(acc)),
        tokens=tuple(tokens),
        forwards=1,
        chain_acceptance=tuple(chain[: len(tokens)]) + (0.0,) * (len(tokens) - len(chain)),
        accepted_length=length,
    ),
    anything,
    st.lists(anything, max_size=3),
    st.lists(anything, max_size=3),
    st.lists(st.integers(0, 10**6), min_size=1, max_size=3),
)
actions = st.one_of(st.none(), st.floats(0, 10, allow_nan=False))


@SETTINGS
@given(
    target=st.floats(-5, 5, allow_nan=False),
    below=actions,
    above=actions,
    metric=st.sampled_from(["accepted_length", "acceptance", "chain_acceptance"]),
    window=st.integers(1, 4),
    updates=st.lists(st.lists(figures, max_size=3), max_size=6),
)
def test_the_weight_is_always_one_of_the_two_actions(target, below, above, metric, window, updates):
    controller = AcceptanceController(
        target=target, below=below, above=above, metric=metric, window=window
    )
    for batch in updates:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeadDrafterWarning)
                weight = controller.update(*batch)
        except PolicyError:  # figures of a model shallower than the depth asked for
            continue
        assert weight in (below, above)
        assert controller.value is None or controller.value == controller.value  # never NaN
        assert controller.death.reached or not controller.dead  # only a drafter that lived dies


points = st.dictionaries(st.integers(0, 10**6), st.floats(0, 10, allow_nan=False), min_size=1)


@SETTINGS
@given(points=points, step=st.integers(0, 2 * 10**6), interpolate=st.booleans())
def test_a_schedule_gives_one_of_its_weights_or_one_between_two(points, step, interpolate):
    weight = loss_scale_schedule(points, step, interpolate=interpolate)
    if interpolate:
        assert min(points.values()) <= weight <= max(points.values())
    else:
        assert weight in points.values()


@SETTINGS
@given(
    points=st.dictionaries(st.one_of(st.integers(), st.floats(), st.text(max_size=3)), anything),
    step=st.one_of(st.integers(), st.floats(), st.text(max_size=3), st.none(), st.booleans()),
)
def test_a_schedule_of_anything_is_a_weight_or_a_policy_error(points, step):
    try:
        weight = loss_scale_schedule(points, step)
    except PolicyError:
        return
    assert weight >= 0 and weight == weight

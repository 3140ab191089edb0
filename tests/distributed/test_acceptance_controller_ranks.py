"""Two data-parallel ranks with different local acceptance decide the same MTP weight."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import _scenarios  # noqa: E402
from _harness import run_ranks  # noqa: E402

pytestmark = pytest.mark.multirank


def test_ranks_fed_different_metrics_agree_after_the_token_weighted_reduction(tmp_path):
    results = run_ranks(_scenarios.controller_decisions, world=2, tp=1, tmp=tmp_path)
    for result in results:
        assert result["ok"], result.get("traceback")
    assert [r["weights"] for r in results] == [[0.3, None], [0.3, None]]
    assert [r["run"] for r in results] == [False, False]
    assert results[0]["value"] == results[1]["value"] == pytest.approx(1.7)


def test_a_depth_the_model_lacks_is_refused_on_every_rank_without_a_hang(tmp_path):
    results = run_ranks(_scenarios.controller_refusal, world=2, tp=1, tmp=tmp_path)
    for result in results:
        assert result["ok"], result.get("traceback")
        assert result["raised"] and "depth 2 was asked for" in result["raised"]


def test_ranks_with_different_engine_acceptance_draft_the_same_number_of_tokens(tmp_path):
    results = run_ranks(_scenarios.speculation_advice, world=2, tp=1, tmp=tmp_path)
    for result in results:
        assert result["ok"], result.get("traceback")
    assert [r["alone"] for r in results] == [2, 0]  # what each rank would do by itself
    assert [r["shared"] for r in results] == [1, 1]
    assert results[0]["chain"] == results[1]["chain"] == pytest.approx([0.5, 0.4])

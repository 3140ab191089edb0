"""With several ranks, a policy file edit reaches every rank at reload(), identically."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import _scenarios  # noqa: E402
from _harness import run_ranks  # noqa: E402

pytestmark = pytest.mark.multirank


def test_ranks_adopt_a_file_edit_together_and_only_at_reload(tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_TEST_DIR", str(tmp_path))
    results = run_ranks(_scenarios.policy_file_edits, world=2, tp=1, tmp=tmp_path)
    for result in results:
        assert result["ok"], result.get("traceback")
    # skip before the edit, still skip after it, run after reload() on both ranks
    assert [r["seen"] for r in results] == [[False, False, True], [False, False, True]]

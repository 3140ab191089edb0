"""Phases: the built-in enum, custom declarations, and the contextvar-based current phase."""

from __future__ import annotations

import asyncio
import threading

import pytest

import mtp_hooks
from mtp_hooks import Phase


def test_phase_is_a_str_enum_with_the_three_builtin_values():
    assert [p.value for p in Phase] == ["train", "eval", "rollout"]
    assert Phase.TRAIN == "train" and isinstance(Phase.EVAL, str)


def test_current_phase_is_none_outside_any_phase_block():
    assert mtp_hooks.current_phase() is None


def test_phase_blocks_nest_and_the_innermost_wins():
    with mtp_hooks.phase("train"):
        with mtp_hooks.phase(Phase.ROLLOUT):
            assert mtp_hooks.current_phase() is Phase.ROLLOUT
        assert mtp_hooks.current_phase() is Phase.TRAIN
    assert mtp_hooks.current_phase() is None


def test_phase_block_is_left_even_when_its_body_raises():
    with pytest.raises(RuntimeError):
        with mtp_hooks.phase("eval"):
            raise RuntimeError("boom")
    assert mtp_hooks.current_phase() is None


def test_unknown_phase_is_an_error_listing_the_known_phases():
    with pytest.raises(
        mtp_hooks.PolicyError, match="unknown phase 'distill'.*train, eval, rollout"
    ):
        with mtp_hooks.phase("distill"):
            pass


def test_a_phase_declared_through_the_api_is_accepted():
    mtp_hooks.declare_phase("distill")
    with mtp_hooks.phase("distill"):
        assert mtp_hooks.current_phase() == "distill"
    assert mtp_hooks.decide(None, "distill").run is True


def test_a_phase_declared_by_a_plugin_hook_is_accepted():
    class DeclaresDistill:
        @mtp_hooks.plugins.hookimpl
        def declare_phases(self):
            return ["distill"]

    with pytest.raises(mtp_hooks.PolicyError):
        mtp_hooks.decide(None, "distill")
    mtp_hooks.plugins.register(DeclaresDistill(), name="declares-distill")
    assert mtp_hooks.decide(None, "distill").decided_by == "default"


def test_a_plugin_phase_is_forgotten_when_the_plugin_is_unregistered():
    class DeclaresDistill:
        @mtp_hooks.plugins.hookimpl
        def declare_phases(self):
            return ["distill"]

    mtp_hooks.plugins.register(DeclaresDistill(), name="declares-distill")
    mtp_hooks.plugins.unregister("declares-distill")
    with pytest.raises(mtp_hooks.PolicyError, match="unknown phase"):
        mtp_hooks.decide(None, "distill")


def test_declaring_a_non_identifier_phase_is_an_error():
    with pytest.raises(mtp_hooks.PolicyError, match="not a valid phase name"):
        mtp_hooks.declare_phase("log prob")


def test_each_thread_sees_only_its_own_phase():
    seen: dict[str, object] = {}
    ready = threading.Barrier(2)

    def worker(name: str) -> None:
        with mtp_hooks.phase(name):
            ready.wait(timeout=10)  # both threads are inside their blocks at once
            seen[name] = mtp_hooks.current_phase()

    threads = [threading.Thread(target=worker, args=(n,)) for n in ("train", "rollout")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert seen == {"train": Phase.TRAIN, "rollout": Phase.ROLLOUT}


def test_a_new_thread_does_not_inherit_the_callers_phase():
    seen = []
    with mtp_hooks.phase("eval"):
        t = threading.Thread(target=lambda: seen.append(mtp_hooks.current_phase()))
        t.start()
        t.join(timeout=10)
    assert seen == [None]


def test_each_asyncio_task_sees_only_its_own_phase():
    async def in_phase(name: str) -> object:
        with mtp_hooks.phase(name):
            await asyncio.sleep(0.01)  # interleave with the other task
            return mtp_hooks.current_phase()

    async def main() -> list[object]:
        return list(await asyncio.gather(in_phase("train"), in_phase("eval")))

    assert asyncio.run(main()) == [Phase.TRAIN, Phase.EVAL]

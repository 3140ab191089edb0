"""The GPU tests' check that attaching changes nothing megatron's inference engine does.

The engine's forwards are inference calls, which the gate leaves untouched under any policy:
the same rollout, with and without the library attached, must give the same tokens, drafts and
accepted drafts, and every forward the gate saw must be counted as an untouched inference call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import mtp_hooks


def assert_attaching_changes_no_rollout(
    model: torch.nn.Module, policy: str, rollout: Callable[[], Any]
) -> Any:
    """Run ``rollout`` with nothing attached, then with ``model`` attached under ``policy``
    (removed after); assert both agree token for token and in their draft counts. Returns the
    rollout with nothing attached, for a test's own checks of it."""
    plain = rollout()
    handle = mtp_hooks.attach(model)
    try:
        mtp_hooks.configure(policy)
        hooked = rollout()
        stats = handle.stats()
    finally:
        handle.remove()
    assert hooked.tokens == plain.tokens
    assert (hooked.drafts, hooked.accepted) == (plain.drafts, plain.accepted)
    assert set(stats) == {"inference"} and set(stats["inference"]) == {"untouched"}
    return plain

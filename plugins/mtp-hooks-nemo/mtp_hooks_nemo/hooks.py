"""The ``mtp_hooks`` entry point of mtp-hooks-nemo: votes from ``megatron_cfg`` or the model."""

from __future__ import annotations

from typing import Any

from mtp_hooks.plugins import hookimpl

from . import vote


@hookimpl
def should_run_mtp(model: Any, phase: Any) -> bool | None:
    return vote(model, phase)

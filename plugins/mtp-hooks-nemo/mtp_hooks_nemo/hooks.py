"""The ``mtp_hooks`` entry point of mtp-hooks-nemo: votes from ``policy.megatron_cfg``."""

from __future__ import annotations

from typing import Any

from mtp_hooks import hookimpl

from . import current


@hookimpl
def should_run_mtp(model: Any, phase: Any) -> bool | None:
    config = current()
    return None if config is None else config.decide(phase)

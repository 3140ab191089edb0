"""The ``mtp_hooks`` entry point of mtp-hooks-verl: votes from veRL's MTP config."""

from __future__ import annotations

from typing import Any

from mtp_hooks import hookimpl, role_of

from . import current


@hookimpl
def should_run_mtp(model: Any, phase: Any) -> bool | None:
    config = current()
    return None if config is None else config.decide(phase, role_of(model))

"""The ``mtp_hooks`` entry point of mtp-hooks-verl: votes from veRL's MTP config."""

from __future__ import annotations

from typing import Any

from mtp_hooks import hookimpl

from . import vote


@hookimpl
def should_run_mtp(model: Any, phase: Any) -> bool | None:
    return vote(model, phase)

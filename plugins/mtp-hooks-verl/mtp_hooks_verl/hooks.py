"""The ``mtp_hooks`` entry point of mtp-hooks-verl: votes from veRL's MTP config."""

from __future__ import annotations

from typing import Any

from mtp_hooks.framework import cacheable_vote
from mtp_hooks.plugins import hookimpl

from . import vote


@hookimpl
@cacheable_vote  # reads only the phase, the role and RoleSettings
def should_run_mtp(model: Any, phase: Any) -> bool | None:
    return vote(model, phase)

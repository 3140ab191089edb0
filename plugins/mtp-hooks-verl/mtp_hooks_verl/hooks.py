"""The ``mtp_hooks`` entry point of mtp-hooks-verl: votes from veRL's MTP config."""

from __future__ import annotations

from typing import Any

from mtp_hooks import ForwardCall
from mtp_hooks.framework import cacheable_vote
from mtp_hooks.plugins import hookimpl

from . import vote


@hookimpl
@cacheable_vote  # phase, role and RoleSettings; a worker's train reads the call (asked anew)
def should_run_mtp(model: Any, phase: Any, call: ForwardCall | None) -> bool | None:
    return vote(model, phase, call)

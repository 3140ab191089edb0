"""The ``mtp_hooks`` entry point of mtp-hooks-modelopt: skip MTP for teacher and student."""

from __future__ import annotations

from typing import Any

from mtp_hooks import role_of
from mtp_hooks.framework import cacheable_vote
from mtp_hooks.plugins import hookimpl

from . import current


@hookimpl
@cacheable_vote  # reads only the phase, the role and RoleSettings
def should_run_mtp(model: Any, phase: Any) -> bool | None:
    config = current()
    return None if config is None else config.decide(role_of(model))

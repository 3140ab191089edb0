"""Where the policy config comes from, and when each source is read.

Sources, highest precedence first:

1. :func:`configure` (a dict, a compact string, or ``None`` to clear it);
2. the ``MTP_HOOKS_POLICY`` environment variable (a compact string);
3. the ``MTP_HOOKS_CONFIG`` environment variable (the path of a TOML file with a ``[policy]``
   table).

Sources merge key by key: an entry of a higher source replaces the same (role, phase) entry of a
lower one. The environment is read at first use and by :func:`reload`; the file's content is
re-checked at most every ``MTP_HOOKS_CONFIG_POLL`` seconds in a single process (``never``: only
by :func:`reload`), never on its own with several ``torch.distributed`` ranks.

What the sources read is published as a new :class:`~mtp_hooks._policy_snapshot.PolicySnapshot`
(:func:`mtp_hooks._runtime.advance`); decisions read that, and :func:`refresh` is the one point
where the sources are read.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

from . import _env, _phase_catalogue, _runtime
from ._errors import PolicyError
from ._policy import ENV_CONFIG, parse_file, parse_policy, read_bytes
from ._policy_entry import Key, PolicyEntry
from ._policy_snapshot import PolicySnapshot

ENV_POLICY = "MTP_HOOKS_POLICY"
ENV_POLL = "MTP_HOOKS_CONFIG_POLL"
ENV_TRACE = "MTP_HOOKS_TRACE"


def _distributed_world() -> bool:
    """Whether this process is one rank of several (never imports torch itself)."""
    dist = sys.modules.get("torch.distributed")
    return bool(
        dist is not None
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() > 1
    )


class PolicySources:
    """The configured policy and the environment sources as last read; what they say together
    is published as the runtime's snapshot while these are the sources in force.

    The environment (``MTP_HOOKS_POLICY``, ``MTP_HOOKS_CONFIG``, ``MTP_HOOKS_TRACE``) is read at
    first use and by :func:`reload`. The file's content is checked for changes at most once per
    ``MTP_HOOKS_CONFIG_POLL`` seconds (default 1; 0 checks at every decision; ``never`` leaves
    it to :func:`reload`) in a single process; with several ``torch.distributed`` ranks only
    :func:`reload` re-reads it.
    """

    def __init__(self) -> None:
        self.api: dict[Key, PolicyEntry] = {}
        self.loaded = False
        self.trace = False
        self.env_policy: dict[Key, PolicyEntry] = {}
        self.path: str | None = None  # MTP_HOOKS_CONFIG made absolute when it was read
        self.poll = 1.0
        self.next_poll = 0.0
        self.file_bytes: bytes | None = None
        self.file_entries: dict[Key, PolicyEntry] = {}
        self.file_error: PolicyError | None = None

    # -- reading the sources -------------------------------------------------------------------
    def load_environment(self, shared: tuple[str | None, bytes | None] | None = None) -> None:
        """Read the environment sources; ``shared`` replaces this rank's policy and file text.
        Nothing is put in force here: :func:`_swap` does that, for these or a candidate."""
        env_policy = os.environ.get(ENV_POLICY) if shared is None else shared[0]
        env_config = os.environ.get(ENV_CONFIG)
        policy = parse_policy(env_policy, f"{ENV_POLICY}={env_policy!r}") if env_policy else {}
        path = os.path.abspath(env_config) if env_config else None
        poll = _poll_seconds()
        content = None
        if path is not None:
            content = read_bytes(path) if shared is None else shared[1]
        entries = parse_file(path, content) if path is not None else {}
        self.env_policy, self.path, self.poll = policy, path, poll
        self.file_bytes, self.file_entries, self.file_error = content, entries, None
        self.trace = _env.flag(ENV_TRACE)
        self.loaded = True
        self.next_poll = time.monotonic() + poll

    def check_file(self) -> None:
        """Re-read the policy file if its content changed (single process, rate-limited)."""
        now = time.monotonic()
        if now < self.next_poll or self.path is None or _distributed_world():
            return
        self.next_poll = now + self.poll
        content = read_bytes(self.path)
        if content == self.file_bytes and self.file_error is None:
            return
        try:
            entries = parse_file(self.path, content)
        except PolicyError as exc:
            self.file_error = exc  # raised at every decision until the file is fixed
        else:
            self.file_bytes, self.file_entries, self.file_error = content, entries, None
        self.publish()

    def watches_file(self) -> bool:
        """Whether a policy file is set and polled (``MTP_HOOKS_CONFIG_POLL`` is not ``never``)."""
        return self.path is not None and math.isfinite(self.poll)

    def polls_file(self) -> bool:
        """Whether a policy file is re-read on its own, at decisions (single process, polled)."""
        return self.watches_file() and not _distributed_world()

    def publish(self) -> None:
        """Put what the sources say in force, as the snapshot's next version."""
        merged = {**self.file_entries, **self.env_policy, **self.api}
        _runtime.advance(entries=merged, trace=self.trace, error=self.file_error)


def _poll_seconds() -> float:
    raw = os.environ.get(ENV_POLL, "1")
    if raw.strip().lower() == "never":
        return math.inf
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (value >= 0 and math.isfinite(value)):  # also NaN
        raise PolicyError(
            f"{ENV_POLL}={raw!r}: expected a number of seconds >= 0, such as 1, or 'never'"
        )
    return value


def _sources() -> PolicySources:
    """The sources in force (``current.sources``), made at first use; ``reload()`` swaps them
    whole, never half-updated."""
    runtime = _runtime.current
    state: PolicySources | None = runtime.sources
    if state is None:
        state = runtime.sources = PolicySources()
    return state


def _watch(state: PolicySources) -> None:
    """Set the runtime's ``watching`` for ``state``, the sources in force: whether
    :func:`refresh` has anything to do (the environment is unread, or a file is watched)."""
    _runtime.current.watching = not state.loaded or state.watches_file()


def configure(policy: str | Mapping[str, Any] | None) -> None:
    """Set the per-phase policy config (the highest-precedence source), or clear it with ``None``.

    The policy is validated completely before anything changes.

    Example:
        >>> import mtp_hooks
        >>> mtp_hooks.configure("train=run,eval=skip,rollout=skip,teacher.train=skip")
        >>> mtp_hooks.configure({"eval": "run", "roles": {"teacher": {"train": "skip"}}})
        >>> mtp_hooks.configure(None)
    """
    configure_as(policy, "mtp_hooks.configure()")


def configure_as(policy: str | Mapping[str, Any] | None, source: str) -> None:
    """:func:`configure`, its entries and errors naming ``source`` (the CLI's ``--policy``)."""
    entries = {} if policy is None else parse_policy(policy, source)
    state = _sources()
    state.api = entries
    state.publish()


def use_only(policy: str, source: str) -> None:
    """Make ``policy`` the only source of this process, the environment's left unread (the
    CLI's ``explain --policy``: what that policy alone decides, whatever the job's
    ``MTP_HOOKS_POLICY`` and ``MTP_HOOKS_CONFIG`` say, broken or not)."""
    entries = parse_policy(policy, source)
    state = PolicySources()
    state.loaded = True
    state.api = entries
    _swap(state)


def reload() -> None:
    """Re-read ``MTP_HOOKS_POLICY``, ``MTP_HOOKS_CONFIG`` and ``MTP_HOOKS_TRACE`` now.

    With several ``torch.distributed`` ranks this is a collective over the default group: every
    rank must call it at the same point of the training loop (between steps), rank 0 reads the
    policy variable and the file, and every rank adopts exactly what rank 0 read. That is the
    only way a file edit reaches a multi-rank job, so ranks never decide from different files.

    Raises:
        PolicyError: A source is malformed; the previous policy stays in force.
    """
    shared = None
    if _distributed_world():
        import torch.distributed as dist

        box: list[Any] = [None]
        if dist.get_rank() == 0:
            path = os.environ.get(ENV_CONFIG)
            box[0] = (os.environ.get(ENV_POLICY), read_bytes(path) if path else None)
        dist.broadcast_object_list(box, src=0)
        shared = box[0]
    candidate = PolicySources()
    candidate.api = _sources().api
    candidate.load_environment(shared)  # validates everything before the swap
    _swap(candidate)


def _swap(state: PolicySources) -> None:
    _runtime.current.sources = state
    _watch(state)
    state.publish()


def lookup(role: str | None, phase: str) -> PolicyEntry | None:
    """Return the config entry for (role, phase): role-scoped first, then the plain phase."""
    return refresh().lookup(role, phase)


def configured_roles() -> list[str]:
    """The roles the policy in force names in its entries, sorted."""
    return refresh().roles()


def configured(role: str | None) -> list[tuple[str, PolicyEntry]]:
    """Each known phase that the policy config gives an entry for ``role``, with the entry:
    what a model that cannot follow an entry refuses at attach."""
    entries = [(name, lookup(role, name)) for name in _phase_catalogue.known_phases()]
    return [(name, entry) for name, entry in entries if entry is not None]


def configured_with(role: str | None, option: str) -> list[str]:
    """The phases whose policy config entry for ``role`` sets the field ``option``
    (``detach``, ``mask``)."""
    return [name for name, entry in configured(role) if getattr(entry.options, option)]


def polls_file() -> bool:
    """Whether the policy in force re-reads its file on its own, at decisions."""
    refresh()
    return _sources().polls_file()


def refresh() -> PolicySnapshot:
    """Bring the policy in force up to date with its sources, and return its snapshot.

    The one point where the sources are read: the environment at the first decision, and the
    policy file (by content, at most every ``MTP_HOOKS_CONFIG_POLL`` seconds) at later ones.
    Every decision refreshes before it reads its cache; a gate's planner refreshes before it
    reuses a plan only while the runtime is ``watching`` (a source not read yet, or a file to
    poll), and otherwise reads the snapshot's version alone.

    Raises:
        PolicyError: The environment, read for the first time, is malformed.
    """
    state = _sources()
    if not state.loaded:
        state.load_environment()
        _swap(state)  # already the sources in force: now what they read is, too
    elif state.path is not None:
        state.check_file()
    return _runtime.current.snapshot

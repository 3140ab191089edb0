"""The per-phase policy config: parsing and validating its three sources, and merging them.

Sources, highest precedence first:

1. :func:`configure` (a dict, a compact string, or ``None`` to clear it);
2. the ``MTP_HOOKS_POLICY`` environment variable (a compact string);
3. the ``MTP_HOOKS_CONFIG`` environment variable (the path of a TOML file with a ``[policy]``
   table).

Sources merge key by key: an entry of a higher source replaces the same (role, phase) entry of a
lower one. Values are ``run``, ``skip`` and ``auto`` (no opinion: the plugins decide).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import _env, _generation, _phases
from ._errors import PolicyError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib


ENV_POLICY = "MTP_HOOKS_POLICY"
ENV_CONFIG = "MTP_HOOKS_CONFIG"
ENV_POLL = "MTP_HOOKS_CONFIG_POLL"
ENV_TRACE = "MTP_HOOKS_TRACE"
VALUES = ("run", "skip", "auto")

Key = tuple[str | None, str]  # (role or None, phase name)


@dataclass(frozen=True)
class PolicyEntry:
    """One (role, phase) setting and where it came from."""

    value: str
    source: str


def _value(raw: object, source: str, key: str) -> str:
    value = raw.strip().lower() if isinstance(raw, str) else raw
    if value not in VALUES:
        raise PolicyError(
            f"{source}: key {key!r} has value {raw!r}; allowed values are 'run', 'skip', 'auto'"
        )
    return value  # type: ignore[return-value]


def _key(raw: object, source: str) -> Key:
    if not isinstance(raw, str) or not raw.strip():
        raise PolicyError(
            f"{source}: empty key {raw!r}; keys are PHASE or ROLE.PHASE, e.g. 'eval' or "
            "'teacher.train'"
        )
    text = raw.strip()
    role, dot, phase_name = text.rpartition(".")
    if dot and not role.isidentifier():
        raise PolicyError(
            f"{source}: key {raw!r} has a malformed role {role!r}; use ROLE.PHASE, e.g. "
            "'teacher.train'"
        )
    phase = _phases.normalize(phase_name, f"{source}: key {raw!r}")
    return (role or None, str(phase))


def _add(entries: dict[Key, PolicyEntry], key: Key, raw_key: str, value: str, source: str) -> None:
    if key in entries:
        raise PolicyError(f"{source}: duplicate key {raw_key!r}; give each (role, phase) once")
    entries[key] = PolicyEntry(value, source)


def _from_mapping(policy: Mapping[str, Any], source: str) -> dict[Key, PolicyEntry]:
    entries: dict[Key, PolicyEntry] = {}
    for raw_key, raw_value in policy.items():
        if raw_key == "roles":
            if not isinstance(raw_value, Mapping):
                raise PolicyError(
                    f"{source}: key 'roles' must be a table of ROLE = {{PHASE = VALUE}}, "
                    f"got {type(raw_value).__name__}"
                )
            for role, table in raw_value.items():
                if not isinstance(role, str) or not role.isidentifier():
                    raise PolicyError(f"{source}: role {role!r} in 'roles' is not an identifier")
                if not isinstance(table, Mapping):
                    raise PolicyError(
                        f"{source}: key 'roles.{role}' must be a table of PHASE = VALUE, "
                        f"got {type(table).__name__}"
                    )
                for phase_name, value in table.items():
                    dotted = f"{role}.{phase_name}"
                    key = _key(dotted, source)
                    _add(entries, key, dotted, _value(value, source, dotted), source)
            continue
        key = _key(raw_key, source)
        _add(entries, key, raw_key, _value(raw_value, source, raw_key), source)
    return entries


def parse_policy(policy: str | Mapping[str, Any], source: str = "policy") -> dict[Key, PolicyEntry]:
    """Validate a policy given as a compact string or a mapping, and return its entries.

    The compact string is ``PHASE=VALUE`` or ``ROLE.PHASE=VALUE`` items separated by commas, e.g.
    ``"train=run,eval=skip,teacher.train=skip"``. The mapping is shaped like the TOML ``[policy]``
    table: ``{"train": "run", "roles": {"teacher": {"train": "skip"}}}``; ``"teacher.train"``
    keys are accepted too.

    Raises:
        PolicyError: Naming the source, the key, the bad value and the allowed values.
    """
    if isinstance(policy, Mapping):
        return _from_mapping(policy, source)
    if not isinstance(policy, str):
        raise PolicyError(
            f"{source}: a policy is a dict or a string like 'train=run,eval=skip', "
            f"not {type(policy).__name__}"
        )
    entries: dict[Key, PolicyEntry] = {}
    for item in policy.split(","):
        if not item.strip():
            continue
        raw_key, sep, raw_value = item.partition("=")
        if not sep:
            raise PolicyError(
                f"{source}: item {item.strip()!r} has no '='; write PHASE=VALUE or "
                "ROLE.PHASE=VALUE with VALUE one of 'run', 'skip', 'auto'"
            )
        key = _key(raw_key, source)
        _add(entries, key, raw_key.strip(), _value(raw_value, source, raw_key.strip()), source)
    return entries


def load_policy_file(path: str | os.PathLike[str]) -> dict[Key, PolicyEntry]:
    """Read and validate the ``[policy]`` table of a TOML file."""
    source = f"{ENV_CONFIG} file {os.fspath(path)!r}"
    try:
        with open(path, "rb") as fh:
            document = tomllib.load(fh)
    except OSError as exc:
        raise PolicyError(f"{source}: cannot read it: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"{source}: invalid TOML: {exc}") from exc
    return _policy_table(document, source)


def _policy_table(document: dict[str, Any], source: str) -> dict[Key, PolicyEntry]:
    policy = document.get("policy")
    if policy is None:
        raise PolicyError(f'{source}: no [policy] table; add one with PHASE = "run"|"skip"')
    if not isinstance(policy, dict):
        raise PolicyError(
            f"{source}: key 'policy' must be a table ([policy]), got {type(policy).__name__}"
        )
    return parse_policy(policy, source)


def _distributed_world() -> bool:
    """Whether this process is one rank of several (never imports torch itself)."""
    dist = sys.modules.get("torch.distributed")
    return bool(
        dist is not None
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() > 1
    )


class _PolicyState:
    """The configured policy, the environment sources as last read, and the merged view.

    The environment (``MTP_HOOKS_POLICY``, ``MTP_HOOKS_CONFIG``, ``MTP_HOOKS_TRACE``) is read at
    first use and by :func:`reload`. The file's content is checked for changes at most once per
    ``MTP_HOOKS_CONFIG_POLL`` seconds (default 1; 0 checks at every decision) in a single
    process; with several ``torch.distributed`` ranks only :func:`reload` re-reads it.
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
        self.merged: dict[Key, PolicyEntry] = {}

    # -- reading the sources -------------------------------------------------------------------
    def load_environment(self, shared: tuple[str | None, bytes | None] | None = None) -> None:
        """Read the environment sources; ``shared`` replaces this rank's policy and file text."""
        env_policy = os.environ.get(ENV_POLICY) if shared is None else shared[0]
        env_config = os.environ.get(ENV_CONFIG)
        policy = parse_policy(env_policy, f"{ENV_POLICY}={env_policy!r}") if env_policy else {}
        path = os.path.abspath(env_config) if env_config else None
        poll = _poll_seconds()
        content = None
        if path is not None:
            content = _read_bytes(path) if shared is None else shared[1]
            if content is None:
                raise PolicyError(f"{ENV_CONFIG} file {path!r}: cannot read it")
        entries = _parse_file(path, content) if path is not None else {}
        self.env_policy, self.path, self.poll = policy, path, poll
        self.file_bytes, self.file_entries, self.file_error = content, entries, None
        self.trace = _env.flag(ENV_TRACE)
        self.loaded = True
        self.next_poll = time.monotonic() + poll
        self.rebuild()

    def check_file(self) -> None:
        """Re-read the policy file if its content changed (single process, rate-limited)."""
        now = time.monotonic()
        if now < self.next_poll or self.path is None or _distributed_world():
            return
        self.next_poll = now + self.poll
        content = _read_bytes(self.path)
        if content == self.file_bytes and self.file_error is None:
            return
        try:
            if content is None:
                raise PolicyError(f"{ENV_CONFIG} file {self.path!r}: cannot read it")
            entries = _parse_file(self.path, content)
        except PolicyError as exc:
            self.file_error = exc  # raised at every decision until the file is fixed
            _generation.advance()
            return
        self.file_bytes, self.file_entries, self.file_error = content, entries, None
        self.rebuild()

    def rebuild(self) -> None:
        merged = {**self.file_entries, **self.env_policy, **self.api}
        self.merged = merged
        _generation.advance()

    # -- answering -------------------------------------------------------------------------------
    def current(self) -> dict[Key, PolicyEntry]:
        if not self.loaded:
            self.load_environment()
        else:
            self.check_file()
        if self.file_error is not None:
            raise self.file_error
        return self.merged

    def lookup(self, role: str | None, phase: str) -> PolicyEntry | None:
        merged = self.current()
        if role is not None:
            entry = merged.get((role, phase))
            if entry is not None:
                return entry
        return merged.get((None, phase))


def _poll_seconds() -> float:
    raw = os.environ.get(ENV_POLL, "1")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also NaN
        raise PolicyError(f"{ENV_POLL}={raw!r}: expected a number of seconds >= 0, such as 1")
    return value


def _read_bytes(path: str) -> bytes | None:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError:
        return None


def _parse_file(path: str, content: bytes | None) -> dict[Key, PolicyEntry]:
    source = f"{ENV_CONFIG} file {path!r}"
    if content is None:
        raise PolicyError(f"{source}: cannot read it")
    try:
        document = tomllib.loads(content.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise PolicyError(f"{source}: invalid TOML: {exc}") from exc
    return _policy_table(document, source)


_state = _PolicyState()


def configure(policy: str | Mapping[str, Any] | None) -> None:
    """Set the per-phase policy config (the highest-precedence source), or clear it with ``None``.

    The policy is validated completely before anything changes.

    Example:
        >>> import mtp_hooks
        >>> mtp_hooks.configure("train=run,eval=skip,rollout=skip,teacher.train=skip")
        >>> mtp_hooks.configure({"eval": "run", "roles": {"teacher": {"train": "skip"}}})
        >>> mtp_hooks.configure(None)
    """
    entries = {} if policy is None else parse_policy(policy, "mtp_hooks.configure()")
    _state.api = entries
    _state.rebuild()


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
            box[0] = (os.environ.get(ENV_POLICY), _read_bytes(path) if path else None)
        dist.broadcast_object_list(box, src=0)
        shared = box[0]
    candidate = _PolicyState()
    candidate.api = _state.api
    candidate.load_environment(shared)  # validates everything before the swap
    _swap(candidate)


def _swap(state: _PolicyState) -> None:
    global _state
    _state = state
    _generation.advance()


def _reset() -> None:
    _swap(_PolicyState())


def lookup(role: str | None, phase: str) -> PolicyEntry | None:
    """Return the config entry for (role, phase): role-scoped first, then the plain phase."""
    return _state.lookup(role, phase)


def tracing() -> bool:
    """Whether ``MTP_HOOKS_TRACE`` was on when the environment was last read."""
    return _state.trace


def generation() -> int:
    """The decision-cache counter, after checking the policy file for changes (on the hot path
    of every gated forward: two attribute reads when no file is configured)."""
    state = _state
    if state.path is not None or not state.loaded:
        if not state.loaded:
            state.current()
        else:
            state.check_file()
    return _generation.counter[0]

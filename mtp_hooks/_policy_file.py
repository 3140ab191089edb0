"""The policy in a TOML file: reading it, and validating its ``[policy]`` table.

``MTP_HOOKS_CONFIG`` names the file; :mod:`mtp_hooks._sources` decides when it is read, and
:mod:`mtp_hooks._policy` parses the table as it parses a dict.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ._errors import PolicyError
from ._policy import parse_policy
from ._policy_entry import Key, PolicyEntry

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

ENV_CONFIG = "MTP_HOOKS_CONFIG"


def load_policy_file(path: str | os.PathLike[str]) -> dict[Key, PolicyEntry]:
    """Read and validate the ``[policy]`` table of a TOML file."""
    try:
        with open(path, "rb") as fh:
            content = fh.read()
    except OSError as exc:
        source = f"{ENV_CONFIG} file {os.fspath(path)!r}"
        raise PolicyError(
            f"{source}: cannot read it: {exc.strerror or exc}", source=source
        ) from exc
    return parse_file(os.fspath(path), content)


def _policy_table(document: dict[str, Any], source: str) -> dict[Key, PolicyEntry]:
    policy = document.get("policy")
    if policy is None:
        raise PolicyError(
            f'{source}: no [policy] table; add one with PHASE = "run"|"skip"', source=source
        )
    if not isinstance(policy, dict):
        raise PolicyError(
            f"{source}: key 'policy' must be a table ([policy]), got {type(policy).__name__}",
            source=source,
        )
    return parse_policy(policy, source)


def read_bytes(path: str) -> bytes | None:
    """The file's content, or ``None`` where it cannot be read (``parse_file`` says so)."""
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError:
        return None


def parse_file(path: str, content: bytes | None) -> dict[Key, PolicyEntry]:
    """Validate the ``[policy]`` table of a TOML file's ``content`` (``None``: unreadable)."""
    source = f"{ENV_CONFIG} file {path!r}"
    if content is None:
        raise PolicyError(f"{source}: cannot read it", source=source)
    try:
        document = tomllib.loads(content.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise PolicyError(f"{source}: invalid TOML: {exc}", source=source) from exc
    return _policy_table(document, source)

"""The per-phase policy config: parsing and validating a policy, from a string, dict or file.

The sources themselves, and when they are read, are in :mod:`mtp_hooks._sources`; a TOML file
(``MTP_HOOKS_CONFIG``) holds the policy in its ``[policy]`` table, parsed as a dict is. Values are
``run``, ``skip`` and ``auto`` (no opinion: the plugins decide); ``run:WEIGHT`` also sets the MTP
loss weight. Options follow ``run`` or ``auto`` in any order: ``+metrics`` records MTP quality
metrics, ``+detach`` trains MTP without its gradient reaching the trunk, ``+mask:labels`` keeps
the MTP loss off positions whose label is the ignore index (``run:0.3+detach+mask:labels``),
``+objective:kl`` or ``+objective:tv`` (with ``+detach``) trains MTP toward the policy's own
next-token distribution instead of the labels.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from typing import Any

from . import _options, _phase_catalogue
from ._errors import PolicyError, about
from ._policy_entry import (
    VALUES,
    Key,
    PolicyEntry,
    PolicyValue,
    allowed_values,
    by_name,
    listed,
    plus_options,
    table_keys,
    unknown_key_hint,
    unknown_option_hint,
)
from ._policy_errors import Errors, did_you_mean
from ._weights import parse_loss_scale

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

__all__ = ["load_policy_file", "parse_file", "parse_policy"]

# VALUE[:WEIGHT](+OPTION)*, spaces allowed around ':' and '+'. An option starts with a letter,
# so the '+' of an exponent (run:1e+3) is part of the weight.
_GRAMMAR = re.compile(
    r"\s*(?P<value>[a-z]+)\s*(?::\s*(?P<weight>[^+\s]*(?:[eE]\+[^+\s]*)?)\s*)?"
    r"(?P<options>(?:\+\s*[a-z][a-z_]*(?:\s*:\s*[a-z_]+)?\s*)*)",
    re.ASCII,
)


def _value(raw: object, source: str, key: str) -> PolicyEntry:
    """A policy value: a string such as ``run:0.3+detach``, or a
    ``{mtp, loss_scale, metrics, detach}`` table; an error's ``option`` is the string as given,
    or the table key at fault."""
    with about(option=raw.strip() if isinstance(raw, str) else None):
        return _checked_value(raw, source, key)


def _checked_value(raw: object, source: str, key: str) -> PolicyEntry:
    where = f"{source}: key {key!r}"
    if isinstance(raw, Mapping):
        value, table = _table_value(raw, source, key, where)
    elif isinstance(raw, str):
        value, table = _compact_value(raw, where, source)
    else:
        raise PolicyError(f"{where} has value {raw!r}; allowed values are {allowed_values()}")
    fields: dict[str, Any] = {}
    in_force = _options.options()  # loaded before the loop, so that a loading error is its own
    try:
        for option in in_force:  # in order: an option may read those before it
            fields.update(option.parse(table, where, value, fields))
    except Exception as exc:
        _options.reraise(option, "parse", exc)
    return PolicyEntry(value, source, _options.entry_options(fields))


def _table_value(
    raw: Mapping[Any, Any], source: str, key: str, where: str
) -> tuple[PolicyValue, Mapping[str, Any]]:
    """A TOML table's value (``mtp``) and the table, whose option keys are checked by name."""
    keys = table_keys()
    unknown = sorted(str(k) for k in set(raw) - set(keys))
    if unknown:
        names = ", ".join(f"{k!r}{unknown_key_hint(k)}" for k in unknown)
        takes = listed([repr(k) for k in keys])
        raise PolicyError(
            option=unknown[0],
            message=f"{where}: unknown table key {names}; a table takes {takes}",
        )
    mtp = raw.get("mtp")
    if not isinstance(mtp, str) or mtp.strip().lower() not in VALUES:
        rest = listed([repr(k) for k in keys[1:]])
        hint = f"; 'mtp' = {mtp!r}{did_you_mean(mtp, VALUES)}" if isinstance(mtp, str) else ""
        raise PolicyError(
            f"{where} has the table {dict(raw)!r}{hint}; a table takes 'mtp' (required: "
            f"'run', 'skip' or 'auto', with no weight or option in it), {rest}, e.g. "
            '{mtp = "run", loss_scale = 0.3, metrics = true, detach = true, mask = "labels"}'
        )
    return _value(raw["mtp"], source, key).value, raw


def _compact_value(raw: str, where: str, source: str) -> tuple[PolicyValue, dict[str, Any]]:
    """A policy string's value, and its weight and options read into a table: ``+detach`` is
    ``detach = true``, ``+mask:labels`` is ``mask = "labels"``, ``run:0.3`` ``loss_scale = 0.3``.
    An unknown value and each unknown option are errors of their own, each with its hint."""
    match = _GRAMMAR.fullmatch(raw.lower())
    if match is None:
        hint = " (items are separated by ',', not ';')" if ";" in raw else ""
        raise PolicyError(f"{where} has value {raw!r}{hint}; allowed values are {allowed_values()}")
    table: dict[str, Any] = {}
    errors = Errors(source)
    named = VALUES.get(match["value"])
    with errors:
        if named is None:
            hint = did_you_mean(match["value"], VALUES)
            raise PolicyError(
                option=match["value"],
                message=f"{where} has value {raw!r}{hint}; allowed values are {allowed_values()}",
            )
    for given in ("".join(o.split()) for o in match["options"].split("+")[1:]):
        with errors:
            _add_option(table, given, raw, where)
    errors.raise_any()
    assert named is not None  # an unknown value was raised above
    if match["weight"] is not None:
        if named != "run":
            raise PolicyError(f"{where} has value {raw!r}; allowed values are {allowed_values()}")
        table["loss_scale"] = parse_loss_scale(match["weight"], where)
    return named, table


def _add_option(table: dict[str, Any], given: str, raw: str, where: str) -> None:
    """The option ``+given`` of the policy string ``raw`` into ``table``."""
    name, colon, argument = given.partition(":")
    option = by_name(name)
    if option is None or bool(colon) != bool(option.choices):
        raise PolicyError(
            option=f"+{given}",
            message=f"{where} has value {raw!r}; unknown option '+{given}'"
            f"{unknown_option_hint(given)}: the '+' options are {plus_options()}",
        )
    if name in table:
        raise PolicyError(f"{where} has value {raw!r}; give '+{name}' once", option=f"+{name}")
    table[name] = argument if colon else True


def _key(raw: object, source: str) -> Key:
    if not isinstance(raw, str):
        raise PolicyError(
            f"{source}: key {raw!r} is not a string; keys are PHASE or ROLE.PHASE, e.g. 'eval' "
            "or 'teacher.train'"
        )
    if not raw.strip():
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
    with about(role=role or None, phase=phase_name.strip(), source=source):
        phase = _phase_catalogue.normalize(phase_name, f"{source}: key {raw!r}")
    return (role or None, str(phase))


def _add(
    entries: dict[Key, PolicyEntry],
    key: Key,
    raw_key: str,
    raw_value: object,
    source: str,
) -> None:
    """The entry of ``key`` (``raw_key`` as written) with ``raw_value`` into ``entries``; an
    error names the key's role and phase."""
    with about(role=key[0], phase=key[1]):
        value = _value(raw_value, source, raw_key)
        if key in entries:
            raise PolicyError(f"{source}: duplicate key {raw_key!r}; give each (role, phase) once")
        entries[key] = value


def _from_mapping(policy: Mapping[str, Any], source: str) -> dict[Key, PolicyEntry]:
    entries: dict[Key, PolicyEntry] = {}
    errors = Errors(source)
    for raw_key, raw_value in policy.items():
        with errors:
            _from_item(entries, raw_key, raw_value, source, errors)
    errors.raise_any()
    return entries


def _key_and_value(
    entries: dict[Key, PolicyEntry], raw_key: Any, raw_value: object, source: str
) -> None:
    """One ``PHASE`` or ``ROLE.PHASE`` key and its value into ``entries``, each checked on its
    own: a bad key hides no error of its value (``trian=skp`` names both)."""
    errors = Errors(source)
    key: Key | None = None
    with errors:
        key = _key(raw_key, source)
    named = raw_key.strip() if isinstance(raw_key, str) else repr(raw_key)
    with errors:
        if key is None:
            _value(raw_value, source, named)
        else:
            _add(entries, key, named, raw_value, source)
    errors.raise_any()


def _from_item(
    entries: dict[Key, PolicyEntry], raw_key: Any, raw_value: Any, source: str, errors: Errors
) -> None:
    """One key of a mapping policy into ``entries`` (each of a ``roles`` table's own keys is
    checked apart, its errors gathered in ``errors``)."""
    if raw_key == "roles":
        if not isinstance(raw_value, Mapping):
            raise PolicyError(
                f"{source}: key 'roles' must be a table of ROLE = {{PHASE = VALUE}}, "
                f"got {type(raw_value).__name__}"
            )
        for role, table in raw_value.items():
            with errors:  # a malformed role hides no other role's errors
                _from_role(entries, role, table, source, errors)
        return
    if (
        isinstance(raw_key, str)
        and isinstance(raw_value, Mapping)
        and did_you_mean(raw_key, ["roles"])
        and all(isinstance(v, Mapping) for v in raw_value.values())
    ):  # a table of tables under a near miss of 'roles': [policy.role.teacher]
        raise PolicyError(
            f"{source}: key {raw_key!r} (did you mean 'roles'?) holds tables like a roles "
            "table; a role's entries go under 'roles', e.g. [policy.roles.teacher]",
            option=raw_key,
        )
    _key_and_value(entries, raw_key, raw_value, source)


def _from_role(
    entries: dict[Key, PolicyEntry], role: Any, table: Any, source: str, errors: Errors
) -> None:
    """One role of a ``roles`` table into ``entries``, each phase's errors in ``errors``."""
    if not isinstance(role, str) or not role.isidentifier():
        raise PolicyError(f"{source}: role {role!r} in 'roles' is not an identifier")
    if not isinstance(table, Mapping):
        raise PolicyError(
            f"{source}: key 'roles.{role}' must be a table of PHASE = VALUE, "
            f"got {type(table).__name__}"
        )
    for phase_name, value in table.items():
        with errors:
            _key_and_value(entries, f"{role}.{phase_name}", value, source)


def parse_policy(policy: str | Mapping[str, Any], source: str = "policy") -> dict[Key, PolicyEntry]:
    """Validate a policy given as a compact string or a mapping, and return its entries.

    The compact string is ``PHASE=VALUE`` or ``ROLE.PHASE=VALUE`` items separated by single
    commas (an empty or blank string is no policy; an empty item is an error), e.g.
    ``"train=run:0.3+detach,eval=run+metrics,teacher.train=skip"``; ``run:WEIGHT`` also sets
    the MTP loss weight, ``+metrics`` records MTP loss and acceptance, and ``+detach`` keeps the
    MTP loss's gradient out of the trunk. The mapping is shaped like the
    TOML ``[policy]`` table: ``{"train": {"mtp": "run", "loss_scale": 0.3}, "roles":
    {"teacher": {"train": "skip"}}}``; ``"teacher.train"`` keys and ``"run:0.3"`` strings are
    accepted too.

    Raises:
        PolicyError: Naming the source, the key, the bad value and the allowed values.
    """
    if isinstance(policy, Mapping):
        return _from_mapping(policy, source)
    if not isinstance(policy, str):
        raise PolicyError(
            source=source,
            message=f"{source}: a policy is a dict or a string like 'train=run,eval=skip', "
            f"not {type(policy).__name__}",
        )
    entries: dict[Key, PolicyEntry] = {}
    if not policy.strip():  # an empty MTP_HOOKS_POLICY: no policy from this source
        return entries
    items = policy.split(",")
    errors = Errors(source)
    for number, item in enumerate(items, 1):
        with errors:
            _from_compact_item(entries, number, item, items, policy, source)
    errors.raise_any()
    return entries


def _from_compact_item(
    entries: dict[Key, PolicyEntry],
    number: int,
    item: str,
    items: list[str],
    policy: str,
    source: str,
) -> None:
    """Item ``number`` of a compact policy string into ``entries``."""
    if not item.strip():
        raise PolicyError(
            f"{source}: item {number} of {len(items)} in {policy!r} is empty (a stray "
            "comma); separate PHASE=VALUE items by single commas, with none at either end"
        )
    raw_key, sep, raw_value = item.partition("=")
    if not sep:
        raise PolicyError(
            f"{source}: item {item.strip()!r} has no '='; write PHASE=VALUE or "
            "ROLE.PHASE=VALUE with VALUE one of 'run', 'skip', 'auto'"
        )
    _key_and_value(entries, raw_key, raw_value, source)


# -- a TOML file ------------------------------------------------------------------------------

ENV_CONFIG = "MTP_HOOKS_CONFIG"


def load_policy_file(
    path: str | os.PathLike[str], origin: str | None = ENV_CONFIG
) -> dict[Key, PolicyEntry]:
    """Read and validate the ``[policy]`` table of a TOML file; errors name it as
    ``"{origin} file 'PATH'"`` (``origin=None``: ``"file 'PATH'"``, a file given directly)."""
    try:
        with open(path, "rb") as fh:
            content = fh.read()
    except OSError as exc:
        source = _file_source(os.fspath(path), origin)
        raise PolicyError(
            f"{source}: cannot read it: {exc.strerror or exc}", source=source
        ) from exc
    return parse_file(os.fspath(path), content, origin)


def _file_source(path: str, origin: str | None) -> str:
    return f"{origin} file {path!r}" if origin else f"file {path!r}"


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


def parse_file(
    path: str, content: bytes | None, origin: str | None = ENV_CONFIG
) -> dict[Key, PolicyEntry]:
    """Validate the ``[policy]`` table of a TOML file's ``content`` (``None``: unreadable);
    ``origin`` as for :func:`load_policy_file`."""
    source = _file_source(path, origin)
    if content is None:
        raise PolicyError(f"{source}: cannot read it", source=source)
    try:
        document = tomllib.loads(content.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise PolicyError(f"{source}: invalid TOML: {exc}", source=source) from exc
    return _policy_table(document, source)

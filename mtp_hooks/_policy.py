"""The per-phase policy config: parsing and validating a policy, from a string, dict or file.

The sources themselves, and when they are read, are in :mod:`mtp_hooks._sources`. Values are
``run``, ``skip`` and ``auto`` (no opinion: the plugins decide); ``run:WEIGHT`` also sets the MTP
loss weight. Options follow ``run`` or ``auto`` in any order: ``+metrics`` records MTP quality
metrics, ``+detach`` trains MTP without its gradient reaching the trunk, ``+mask:labels`` keeps
the MTP loss off positions whose label is the ignore index (``run:0.3+detach+mask:labels``),
``+objective:kl`` or ``+objective:tv`` (with ``+detach``) trains MTP toward the policy's own
next-token distribution instead of the labels.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from . import _phase_catalogue
from ._errors import PolicyError, about
from ._policy_entry import VALUES, Key, PolicyEntry
from ._policy_errors import Errors, did_you_mean
from ._weights import check_loss_scale, parse_loss_scale
from .hookspecs import OBJECTIVES

__all__ = ["IGNORE_INDEX", "parse_policy"]

_ALLOWED = (
    "'run', 'skip', 'auto', 'run:WEIGHT' (e.g. 'run:0.3'), each of the run/auto forms "
    "optionally followed by '+metrics', '+detach', '+mask:labels' and '+objective:kl' "
    "(or ':tv', ':ce'), in any order"
)
# VALUE[:WEIGHT](+OPTION)*, spaces allowed around ':' and '+'. An option starts with a letter,
# so the '+' of an exponent (run:1e+3) is part of the weight.
_GRAMMAR = re.compile(
    r"\s*(?P<value>[a-z]+)\s*(?::\s*(?P<weight>[^+\s]*(?:[eE]\+[^+\s]*)?)\s*)?"
    r"(?P<options>(?:\+\s*[a-z][a-z_]*(?:\s*:\s*[a-z_]+)?\s*)*)",
    re.ASCII,
)
OPTIONS = ("metrics", "detach")
MASKS = ("labels",)  # the mask sources of '+mask:SOURCE' (TOML mask = "SOURCE")
_NAMED = ("mask", "objective")  # the options that take ':NAME'
IGNORE_INDEX = -100  # torch's cross-entropy default, and what megatron's datasets write
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # labels are int64: a label outside can never match
_TABLE_KEYS = {
    "mtp", "loss_scale", *OPTIONS, "mask", "ignore_index", "plugin_masks", "objective",
    "temperature",
}  # fmt: skip


def _mask(raw: object, where: str, value: str) -> str | None:
    """A mask source (``+mask:labels``, TOML ``mask = "labels"``), checked."""
    if raw is None:
        return None
    if not isinstance(raw, str) or raw.strip().lower() not in MASKS:
        raise PolicyError(
            f"{where}: unknown MTP loss mask source {raw!r}; the sources are "
            + ", ".join(repr(m) for m in MASKS)
            + " ('+mask:labels': leave out positions whose label is the ignore index)"
        )
    _check_option(f"mask:{raw.strip().lower()}", True, where, value)
    return raw.strip().lower()


def _objective(
    raw: object, temperature: object, detach: bool | None, where: str, value: str
) -> tuple[str | None, float | None]:
    """An objective (``+objective:kl``, TOML ``objective = "kl"``) and its temperature,
    checked: ``kl`` and ``tv`` train MTP toward the policy itself, so they need ``+detach``
    (the trunk must never learn from its own drafter's target)."""
    if temperature is not None and raw not in ("kl", "tv"):
        raise PolicyError(
            f'{where}: \'temperature\' is the temperature of objective = "kl" or "tv"; add '
            "one of them, or drop 'temperature'"
        )
    if raw is None:
        return None, None
    if not isinstance(raw, str) or raw.strip().lower() not in OBJECTIVES:
        hint = did_you_mean(raw, OBJECTIVES) if isinstance(raw, str) else ""
        raise PolicyError(
            f"{where}: unknown MTP objective {raw!r}{hint}; the objectives are 'ce' (megatron's "
            "cross-entropy against the labels), 'kl' (the policy's own next-token "
            "distribution) and 'tv' (the total variation to it)"
        )
    name = raw.strip().lower()
    _check_option(f"objective:{name}", True, where, value)
    if name != "ce" and not detach:
        raise PolicyError(
            f"{where}: '+objective:{name}' trains MTP toward the policy's own next-token "
            f"distribution, which must never train the trunk: write 'run+detach+objective:"
            f"{name}' (TOML detach = true), or use objective 'ce'"
        )
    if temperature is None:
        return name, None
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise PolicyError(f"{where}: 'temperature' is a number, not {temperature!r}")
    if not math.isfinite(temperature) or temperature <= 0:
        raise PolicyError(f"{where}: 'temperature' must be finite and above 0, not {temperature!r}")
    return name, float(temperature)


def _value(raw: object, source: str, key: str) -> PolicyEntry:
    """A policy value: a string such as ``run:0.3+detach``, or a
    ``{mtp, loss_scale, metrics, detach}`` table; an error's ``option`` is the string as given,
    or the table key at fault."""
    with about(option=raw.strip() if isinstance(raw, str) else None):
        return _checked_value(raw, source, key)


def _checked_value(raw: object, source: str, key: str) -> PolicyEntry:
    where = f"{source}: key {key!r}"
    if isinstance(raw, Mapping):
        unknown = sorted(str(k) for k in set(raw) - _TABLE_KEYS)
        if unknown:
            listed = ", ".join(f"{k!r}{did_you_mean(k, _TABLE_KEYS)}" for k in unknown)
            raise PolicyError(
                option=unknown[0],
                message=f"{where}: unknown table key {listed}; a table takes 'mtp', 'loss_scale', "
                "'metrics', 'detach', 'mask', 'ignore_index', 'plugin_masks', 'objective' and "
                "'temperature'",
            )
        mtp = raw.get("mtp")
        if not isinstance(mtp, str) or mtp.strip().lower() not in VALUES:
            raise PolicyError(
                f"{where} has the table {dict(raw)!r}; a table takes 'mtp' (required: "
                "'run', 'skip' or 'auto', with no weight or option in it), 'loss_scale', "
                "'metrics', 'detach', 'mask', 'ignore_index', 'plugin_masks', 'objective' and "
                "'temperature', e.g. "
                '{mtp = "run", loss_scale = 0.3, metrics = true, detach = true, mask = "labels"}'
            )
        value = _value(raw["mtp"], source, key).value
        flags = {}
        for option in OPTIONS:
            flag = raw.get(option)
            if flag is not None and not isinstance(flag, bool):
                raise PolicyError(
                    f"{where}: {option!r} is true or false, not {flag!r}", option=option
                )
            flags[option] = _check_option(option, flag, where, value)
        scale = raw.get("loss_scale")
        example = "loss_scale = 0.3 (a number, unquoted)"
        weight = None if scale is None else check_loss_scale(scale, where, value, example)
        ignore = raw.get("ignore_index")
        if ignore is not None and (isinstance(ignore, bool) or not isinstance(ignore, int)):
            raise PolicyError(
                f"{where}: 'ignore_index' is an integer label, not {ignore!r}",
                option="ignore_index",
            )
        if ignore is not None and not INT64_MIN <= ignore <= INT64_MAX:
            raise PolicyError(
                f"{where}: 'ignore_index' {ignore} does not fit the labels' int64; give a "
                f"label in [{INT64_MIN}, {INT64_MAX}] (torch's default is {IGNORE_INDEX})"
            )
        mask = _mask(raw.get("mask"), where, value)
        if ignore is not None and mask != "labels":
            raise PolicyError(
                f"{where}: 'ignore_index' is the label that mask = \"labels\" leaves out; "
                "add mask = \"labels\", or drop 'ignore_index'"
            )
        plugin_masks = raw.get("plugin_masks")
        if plugin_masks is not None and not isinstance(plugin_masks, bool):
            raise PolicyError(
                f"{where}: 'plugin_masks' is true or false, not {plugin_masks!r}",
                option="plugin_masks",
            )
        objective, temperature = _objective(
            raw.get("objective"), raw.get("temperature"), flags["detach"], where, value
        )
        return PolicyEntry(
            value, source, weight, bool(flags["metrics"]), flags["detach"], mask, ignore,
            plugin_masks, objective, temperature,
        )  # fmt: skip
    if not isinstance(raw, str):
        raise PolicyError(f"{where} has value {raw!r}; allowed values are {_ALLOWED}")
    match = _GRAMMAR.fullmatch(raw.lower())
    if match is None:
        raise PolicyError(f"{where} has value {raw!r}; allowed values are {_ALLOWED}")
    options = ["".join(o.split()) for o in match["options"].split("+")[1:]]
    names = [o.partition(":")[0] for o in options]
    for option, name in zip(options, names, strict=True):
        if name not in (*OPTIONS, *_NAMED) or (":" in option) != (name in _NAMED):
            spelled = ["metrics", "detach", "mask:labels", *(f"objective:{o}" for o in OBJECTIVES)]
            hint = did_you_mean(f"+{option}", [f"+{o}" for o in spelled])
            raise PolicyError(
                option=f"+{option}",
                message=f"{where} has value {raw!r}; unknown option '+{option}'{hint}: the '+' "
                "options are '+metrics', '+detach', '+mask:labels' and '+objective:kl' "
                "(or ':tv', ':ce')",
            )
        if names.count(name) > 1:
            raise PolicyError(f"{where} has value {raw!r}; give '+{name}' once", option=f"+{name}")
    named = VALUES.get(match["value"])
    if named is None:
        hint = did_you_mean(match["value"], VALUES)
        raise PolicyError(f"{where} has value {raw!r}{hint}; allowed values are {_ALLOWED}")
    weight = None
    if match["weight"] is not None:
        if named != "run":
            raise PolicyError(f"{where} has value {raw!r}; allowed values are {_ALLOWED}")
        weight = parse_loss_scale(match["weight"], where)
    metrics, detach = (_check_option(o, o in options or None, where, named) for o in OPTIONS)
    given = [o.partition(":")[2] for o in options if o.startswith("mask:")]
    mask = _mask(given[0], where, named) if given else None
    chosen = [o.partition(":")[2] for o in options if o.startswith("objective:")]
    objective, _ = _objective(chosen[0] if chosen else None, None, detach, where, named)
    return PolicyEntry(named, source, weight, bool(metrics), detach, mask, objective=objective)


def _check_option(option: str, flag: bool | None, where: str, value: str) -> bool | None:
    if flag and value == "skip":
        raise PolicyError(
            option=f"+{option}",
            message=f"{where}: '+{option}' needs MTP to run; write 'run+{option}' (or "
            f"'auto+{option}' to let the plugins decide), or drop '+{option}'",
        )
    return flag


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
            if not isinstance(role, str) or not role.isidentifier():
                raise PolicyError(f"{source}: role {role!r} in 'roles' is not an identifier")
            if not isinstance(table, Mapping):
                raise PolicyError(
                    f"{source}: key 'roles.{role}' must be a table of PHASE = VALUE, "
                    f"got {type(table).__name__}"
                )
            for phase_name, value in table.items():
                dotted = f"{role}.{phase_name}"
                with errors:
                    key = _key(dotted, source)
                    _add(entries, key, dotted, value, source)
        return
    key = _key(raw_key, source)
    _add(entries, key, raw_key, raw_value, source)


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
    key = _key(raw_key, source)
    _add(entries, key, raw_key.strip(), raw_value, source)

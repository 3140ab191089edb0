"""One (role, phase) entry of a policy, and its spelling in the compact grammar.

The options an entry holds are declared in :mod:`mtp_hooks._options`; the parser's messages,
the table keys it accepts and ``check-config``'s spelling of an entry are read from there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from . import _contributed_options, _options
from ._options import Option, Options, entry_options
from ._policy_errors import did_you_mean

PolicyValue = Literal["run", "skip", "auto"]
VALUES: dict[str, PolicyValue] = {"run": "run", "skip": "skip", "auto": "auto"}

Key = tuple[str | None, str]  # (role or None, phase name)


@dataclass(frozen=True)
class PolicyEntry:
    """One (role, phase) setting and where it came from.

    Attributes:
        value: ``"run"``, ``"skip"`` or ``"auto"``.
        source: Where it came from (``mtp_hooks.configure()``, a variable or a file).
        options: What its options give (:class:`~mtp_hooks._options.Options`, each option's
            :attr:`~mtp_hooks._options.Option.given` fields): ``None`` where one is not given,
            and the plugins (or the model's own setting) decide.
    """

    value: PolicyValue
    source: str
    options: Options = field(default_factory=entry_options)


def spell(entry: PolicyEntry) -> str:
    """``entry`` in the compact grammar (``run:0.3+metrics+detach``), which parses back to it.

    The weight is written as Python's shortest round-trip ``repr``. The TOML-only choices
    (``detach = false``, the model's own setting; ``ignore_index``; ``plugin_masks = false``;
    ``temperature``) have no compact spelling and are left out.
    """
    return entry.value + "".join(_options.each("spell", lambda option: option.spell(entry.options)))


def note(entry: PolicyEntry) -> str:
    """What ``check-config`` adds after :func:`spell` for the choices that have no compact
    spelling (``" (detach = false: the model's own)"``)."""
    return "".join(_options.each("note", lambda option: option.note(entry.options)))


def listed(names: list[str]) -> str:
    """``"a, b and c"``."""
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def plus_options() -> str:
    """The ``+`` options as messages list them."""
    return listed([o.shown for o in _options.options() if o.shown])


def table_keys() -> tuple[str, ...]:
    """Every key a TOML policy table takes, ``mtp`` first."""
    return ("mtp", *(key for option in _options.options() for key in option.keys))


def allowed_values() -> str:
    """The values a policy entry takes, as messages list them."""
    return (
        "'run', 'skip', 'auto', 'run:WEIGHT' (e.g. 'run:0.3'), each of the run/auto forms "
        f"optionally followed by {plus_options()}, in any order"
    )


def by_name(name: str) -> Option | None:
    """The ``+`` option called ``name``, or ``None``."""
    return next((o for o in _options.options() if o.shown and o.name == name), None)


def unknown_option_hint(option: str) -> str:
    """Why ``+option`` is unknown where an installed distribution's option of that name is kept
    out, else a did-you-mean."""
    kept_out = _contributed_options.left_out(option.partition(":")[0])
    spelled = [f"+{s}" for o in _options.options() for s in o.spellings]
    return kept_out or did_you_mean(f"+{option}", spelled)


def unknown_key_hint(key: str) -> str:
    """Why the table key ``key`` is unknown where an installed distribution's option of that
    name is kept out, else a did-you-mean."""
    return _contributed_options.left_out(key) or did_you_mean(key, table_keys())

"""One (role, phase) entry of a policy, the options it holds, each declared once, and its
spelling in the compact grammar.

An option follows ``run`` or ``auto`` in a policy string (``run:0.3+detach+mask:labels``) or is
a key of a TOML table (``{mtp = "run", loss_scale = 0.3, detach = true}``). Both spellings reach
the same :attr:`PolicyOption.parse`: :mod:`mtp_hooks._policy` reads a string's options into a
table first, so a value is checked by one function whichever way it was written. The parser's
messages, the table keys it accepts, ``check-config``'s spelling of an entry and the options a
layout that allows only a plain run refuses are all read from :data:`OPTIONS`.

What an option does at a call is its behaviour, kept where that behaviour lives: its step of
the combination rule (``mtp_hooks._decision.STEPS``) fills its decision fields, and the gate
reads its plan fields. docs/contributing.md shows what a new option touches.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from ._errors import PolicyError
from ._policy_errors import did_you_mean
from ._weights import check_loss_scale
from .hookspecs import OBJECTIVES

PolicyValue = Literal["run", "skip", "auto"]
VALUES: dict[str, PolicyValue] = {"run": "run", "skip": "skip", "auto": "auto"}

Key = tuple[str | None, str]  # (role or None, phase name)


@dataclass(frozen=True)
class PolicyEntry:
    """One (role, phase) setting and where it came from.

    Attributes:
        value: ``"run"``, ``"skip"`` or ``"auto"``.
        source: Where it came from (``mtp_hooks.configure()``, a variable or a file).
        loss_scale: The MTP loss weight for a ``run`` entry (``run:0.3``), else ``None``: the
            model's own ``mtp_loss_scaling_factor`` (or a plugin's ``mtp_loss_scale``) applies.
        metrics: Whether forwards that run MTP with labels record MTP loss and top-1 acceptance
            per depth (``run+metrics``, ``auto+metrics``).
        detach: ``True`` (``run+detach``, TOML ``detach = true``): MTP runs on detached trunk
            outputs, embeddings and output weight, so its loss trains only the MTP weights;
            ``False`` (TOML ``detach = false``): the model's own ``mtp_detach_heads``, whatever
            plugins say; ``None``: not set here, plugins may decide.
        mask: ``"labels"`` (``run+mask:labels``, TOML ``mask = "labels"``): the MTP loss also
            leaves out positions whose label is ``ignore_index``; ``None``: no mask of its own.
        ignore_index: The label that ``mask = "labels"`` leaves out (TOML ``ignore_index``;
            ``None``: -100, as in torch's cross-entropy).
        plugin_masks: ``False`` (TOML ``plugin_masks = false``): plugins' ``mtp_loss_mask``
            answers are not asked for; ``None``: they are.
        objective: What MTP's loss trains toward (``+objective:kl``, TOML ``objective =
            "kl"``): ``"kl"`` the policy's own next-token distribution (self-distillation),
            ``"tv"`` the total variation to it, ``"ce"`` or ``None`` megatron's cross-entropy
            against the labels. ``kl`` and ``tv`` need ``+detach``.
        temperature: The temperature of both distributions under ``kl`` or ``tv`` (TOML
            ``temperature``; ``None``: 1).
    """

    value: PolicyValue
    source: str
    loss_scale: float | None = None
    metrics: bool = False
    detach: bool | None = None
    mask: str | None = None
    ignore_index: int | None = None
    plugin_masks: bool | None = None
    objective: str | None = None
    temperature: float | None = None


def spell(entry: PolicyEntry) -> str:
    """``entry`` in the compact grammar (``run:0.3+metrics+detach``), which parses back to it.

    The weight is written as Python's shortest round-trip ``repr``. The TOML-only choices
    (``detach = false``, the model's own setting; ``ignore_index``; ``plugin_masks = false``;
    ``temperature``) have no compact spelling and are left out.
    """
    return entry.value + "".join(option.spell(entry) for option in OPTIONS)


# -- the options ----------------------------------------------------------------------------------

IGNORE_INDEX = -100  # torch's cross-entropy default, and what megatron's datasets write
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # labels are int64: a label outside can never match
MASKS = ("labels",)  # the mask sources of '+mask:SOURCE' (TOML mask = "SOURCE")

Parse = Callable[[Mapping[str, Any], str, str, Mapping[str, Any]], dict[str, Any]]
"""``parse(table, where, value, parsed)``: the checked entry fields of an option from a table
(a string's options read into one), for the entry of ``value`` (``run``, ``skip`` or
``auto``) at ``where``; ``parsed`` holds the fields of the options declared before it."""


@dataclass(frozen=True, slots=True)
class PlanField:
    """A phase plan's field that an option sets (``mtp_hooks.megatron._phase_plan``).

    Attributes:
        field: The plan's field.
        plain: Its value in a plain run or skip.
        says: How a refusal names what asked for it.
        needs_a_run: Whether a call that does not run MTP leaves it undone (plugins' masks only
            weigh a loss that is computed: nothing is lost without one). Default ``True``.
    """

    field: str
    plain: Any
    says: str
    needs_a_run: bool = True


@dataclass(frozen=True, slots=True)
class PolicyOption:
    """One policy option, declared once.

    Attributes:
        name: Its name: the word after ``+`` in a policy string, and its TOML key.
        shown: How the parser's messages list it (``"'+mask:labels'"``); empty for the
            loss weight, which is part of the value (``run:0.3``), not a ``+`` option.
        choices: The names a ``+name:NAME`` option takes (``+objective:kl``); empty for a flag
            (``+detach``) and for the loss weight.
        keys: The TOML table keys it reads: its own name and the keys only it takes
            (``ignore_index`` goes with ``mask``).
        parse: Checks its keys of a table and returns the entry fields it sets (:data:`Parse`).
        spell: Its part of an entry's compact spelling (``"+detach"``), ``""`` when unset.
        entry_fields: The :class:`~mtp_hooks._policy_entry.PolicyEntry` fields it sets.
        decision_fields: The :class:`~mtp_hooks._decision.Decision` fields it sets.
        plan: The phase plan's fields it sets (:class:`PlanField`).
        hook: The plugin hook whose answers set it where the policy config does not
            (``mtp_detach_heads`` for ``detach``), or ``None``: only the config sets it. A
            decision asks an option's step only where the config names the key or a plugin
            implements this hook.
    """

    name: str
    shown: str
    choices: tuple[str, ...]
    keys: tuple[str, ...]
    parse: Parse
    spell: Callable[[PolicyEntry], str]
    entry_fields: tuple[str, ...]
    decision_fields: tuple[str, ...]
    plan: tuple[PlanField, ...]
    hook: str | None = None

    @property
    def spellings(self) -> tuple[str, ...]:
        """Every way it is written after a ``+`` (``detach``, ``objective:kl`` ...)."""
        if not self.shown:
            return ()
        return tuple(f"{self.name}:{c}" for c in self.choices) or (self.name,)


def needs_a_run(option: str, flag: object, where: str, value: str) -> None:
    """Refuse an option given with ``skip``: it needs MTP to run."""
    if flag and value == "skip":
        raise PolicyError(
            option=f"+{option}",
            message=f"{where}: '+{option}' needs MTP to run; write 'run+{option}' (or "
            f"'auto+{option}' to let the plugins decide), or drop '+{option}'",
        )


def _boolean(table: Mapping[str, Any], key: str, where: str) -> bool | None:
    """A table's ``true``/``false`` key, or ``None`` where it is not given."""
    flag = table.get(key)
    if flag is not None and not isinstance(flag, bool):
        raise PolicyError(f"{where}: {key!r} is true or false, not {flag!r}", option=key)
    return flag


def _parse_loss_scale(
    table: Mapping[str, Any], where: str, value: str, parsed: Mapping[str, Any]
) -> dict[str, Any]:
    scale = table.get("loss_scale")
    example = "loss_scale = 0.3 (a number, unquoted)"
    return {"loss_scale": None if scale is None else check_loss_scale(scale, where, value, example)}


def flag_option(
    name: str,
    decision_fields: tuple[str, ...],
    unset: bool | None = None,
    hook: str | None = None,
) -> PolicyOption:
    """A ``+name`` flag (TOML ``name = true``) that needs MTP to run: its entry field and plan
    field are both ``name``, the plan's plain value ``False``. ``unset`` is the entry field
    where it is not given (``None`` lets plugins decide, as for ``detach``)."""

    def parse(
        table: Mapping[str, Any], where: str, value: str, parsed: Mapping[str, Any]
    ) -> dict[str, Any]:
        flag = _boolean(table, name, where)
        needs_a_run(name, flag, where, value)
        return {name: unset if flag is None else flag}

    return PolicyOption(
        name=name,
        shown=f"'+{name}'",
        choices=(),
        keys=(name,),
        parse=parse,
        spell=lambda e: f"+{name}" if getattr(e, name) else "",
        entry_fields=(name,),
        decision_fields=decision_fields,
        plan=(PlanField(name, False, f"+{name}"),),
        hook=hook,
    )


def _parse_mask(
    table: Mapping[str, Any], where: str, value: str, parsed: Mapping[str, Any]
) -> dict[str, Any]:
    ignore = table.get("ignore_index")
    if ignore is not None and (isinstance(ignore, bool) or not isinstance(ignore, int)):
        raise PolicyError(
            f"{where}: 'ignore_index' is an integer label, not {ignore!r}", option="ignore_index"
        )
    if ignore is not None and not INT64_MIN <= ignore <= INT64_MAX:
        raise PolicyError(
            f"{where}: 'ignore_index' {ignore} does not fit the labels' int64; give a "
            f"label in [{INT64_MIN}, {INT64_MAX}] (torch's default is {IGNORE_INDEX})"
        )
    raw, mask = table.get("mask"), None
    if raw is not None:
        if not isinstance(raw, str) or raw.strip().lower() not in MASKS:
            raise PolicyError(
                f"{where}: unknown MTP loss mask source {raw!r}; the sources are "
                + ", ".join(repr(m) for m in MASKS)
                + " ('+mask:labels': leave out positions whose label is the ignore index)"
            )
        mask = raw.strip().lower()
        needs_a_run(f"mask:{mask}", True, where, value)
    if ignore is not None and mask != "labels":
        raise PolicyError(
            f"{where}: 'ignore_index' is the label that mask = \"labels\" leaves out; "
            "add mask = \"labels\", or drop 'ignore_index'"
        )
    plugin_masks = _boolean(table, "plugin_masks", where)
    return {"mask": mask, "ignore_index": ignore, "plugin_masks": plugin_masks}


def _parse_objective(
    table: Mapping[str, Any], where: str, value: str, parsed: Mapping[str, Any]
) -> dict[str, Any]:
    """``kl`` and ``tv`` train MTP toward the policy itself, so they need ``+detach`` (the trunk
    must never learn from its own drafter's target)."""
    raw, temperature = table.get("objective"), table.get("temperature")
    if temperature is not None and raw not in ("kl", "tv"):
        raise PolicyError(
            f'{where}: \'temperature\' is the temperature of objective = "kl" or "tv"; add '
            "one of them, or drop 'temperature'"
        )
    if raw is None:
        return {"objective": None, "temperature": None}
    if not isinstance(raw, str) or raw.strip().lower() not in OBJECTIVES:
        hint = did_you_mean(raw, OBJECTIVES) if isinstance(raw, str) else ""
        raise PolicyError(
            f"{where}: unknown MTP objective {raw!r}{hint}; the objectives are 'ce' (megatron's "
            "cross-entropy against the labels), 'kl' (the policy's own next-token "
            "distribution) and 'tv' (the total variation to it)"
        )
    name = raw.strip().lower()
    needs_a_run(f"objective:{name}", True, where, value)
    if name != "ce" and not parsed["detach"]:
        raise PolicyError(
            f"{where}: '+objective:{name}' trains MTP toward the policy's own next-token "
            f"distribution, which must never train the trunk: write 'run+detach+objective:"
            f"{name}' (TOML detach = true), or use objective 'ce'"
        )
    if temperature is None:
        return {"objective": name, "temperature": None}
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise PolicyError(f"{where}: 'temperature' is a number, not {temperature!r}")
    if not math.isfinite(temperature) or temperature <= 0:
        raise PolicyError(f"{where}: 'temperature' must be finite and above 0, not {temperature!r}")
    return {"objective": name, "temperature": float(temperature)}


OPTIONS: Final = (
    PolicyOption(
        name="loss_scale",
        shown="",
        choices=(),
        keys=("loss_scale",),
        parse=_parse_loss_scale,
        spell=lambda e: "" if e.loss_scale is None else f":{e.loss_scale!r}",
        entry_fields=("loss_scale",),
        decision_fields=("loss_scale", "loss_scale_by"),
        plan=(PlanField("loss_scale", None, "a loss weight (run:W or mtp_loss_scale)"),),
        hook="mtp_loss_scale",
    ),
    flag_option("metrics", ("metrics",), unset=False),
    flag_option("detach", ("detach", "detach_by"), hook="mtp_detach_heads"),
    PolicyOption(
        name="mask",
        shown="'+mask:labels'",
        choices=MASKS,
        keys=("mask", "ignore_index", "plugin_masks"),
        parse=_parse_mask,
        spell=lambda e: "" if e.mask is None else f"+mask:{e.mask}",
        entry_fields=("mask", "ignore_index", "plugin_masks"),
        decision_fields=("mask", "ignore_index", "plugin_masks"),
        plan=(
            PlanField("ignore_index", None, "+mask:labels"),
            PlanField("masks", False, "plugins' mtp_loss_mask answers", needs_a_run=False),
        ),
    ),
    PolicyOption(
        name="objective",
        shown="'+objective:kl' (or ':tv', ':ce')",
        choices=OBJECTIVES,
        keys=("objective", "temperature"),
        parse=_parse_objective,
        spell=lambda e: "" if e.objective is None else f"+objective:{e.objective}",
        entry_fields=("objective", "temperature"),
        decision_fields=("objective", "temperature", "objective_by"),
        plan=(PlanField("objective", None, "+objective"),),
        hook="mtp_objective",
    ),
)
"""Every policy option, in the order the parser checks them and messages list them: an option
may read the fields of those before it (``objective`` reads ``detach``)."""


def listed(names: list[str]) -> str:
    """``"a, b and c"``."""
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def plus_options() -> str:
    """The ``+`` options as messages list them."""
    return listed([o.shown for o in OPTIONS if o.shown])


def table_keys() -> tuple[str, ...]:
    """Every key a TOML policy table takes, ``mtp`` first."""
    return ("mtp", *(key for option in OPTIONS for key in option.keys))


def allowed_values() -> str:
    """The values a policy entry takes, as messages list them."""
    return (
        "'run', 'skip', 'auto', 'run:WEIGHT' (e.g. 'run:0.3'), each of the run/auto forms "
        f"optionally followed by {plus_options()}, in any order"
    )


def by_name(name: str) -> PolicyOption | None:
    """The ``+`` option called ``name``, or ``None``."""
    return next((o for o in OPTIONS if o.shown and o.name == name), None)


def unknown_option_hint(option: str) -> str:
    """A did-you-mean for an unknown ``+option``."""
    spelled = [f"+{s}" for o in OPTIONS for s in o.spellings]
    return did_you_mean(f"+{option}", spelled)


def plan_fields() -> tuple[PlanField, ...]:
    """Every phase-plan field the options set, in :data:`OPTIONS` order."""
    return tuple(field for option in OPTIONS for field in option.plan)

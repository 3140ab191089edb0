"""The policy options, one class each, and the records of an entry's and a plain decision's
values.

An option follows ``run`` or ``auto`` in a policy string (``run:0.3+detach+mask:labels``) or is
a key of a TOML table (``{mtp = "run", loss_scale = 0.3, detach = true}``). Each option is one
:class:`~mtp_hooks._option_base.Option`: it checks its table keys (a string's options are read
into a table first, so one function checks a value whichever way it was written), spells
itself for ``check-config``, checks and combines its plugin hook's answers, says what it
changes in a phase's plan and describes itself for ``mtp-hooks explain``. Entries, decisions
and plans carry the values in one :class:`~mtp_hooks._option_base.Options` record.

What an option does at a forward call beyond the plan (a mask, metrics, an objective) is a
per-call extension of the adapters (``mtp_hooks.megatron._call_extensions``), begun where its
plan part asks for one. docs/contributing.md shows what a new option touches.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Callable, Mapping
from typing import Any, Final, NoReturn, TypeVar

from . import _contributed_options, _runtime
from ._errors import MTPHooksError, PolicyError
from ._option_base import (
    NOTHING,
    Ask,
    Asked,
    Flag,
    Layout,
    Option,
    Options,
    PlanPart,
    boolean,
    needs_a_run,
)
from ._plugin_checks import check_objective, check_vote
from ._policy_errors import did_you_mean
from ._weights import check_loss_scale
from .hookspecs import OBJECTIVES

__all__ = [
    "NOTHING",
    "OPTIONS",
    "Ask",
    "Asked",
    "Flag",
    "Option",
    "Options",
    "PlanPart",
    "options",
]

T = TypeVar("T")

IGNORE_INDEX = -100  # torch's cross-entropy default, and what megatron's datasets write
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # labels are int64: a label outside can never match
MASKS = ("labels",)  # the mask sources of '+mask:SOURCE' (TOML mask = "SOURCE")


class LossScale(Option):
    """``run:W`` (TOML ``loss_scale = W``), or plugins' ``mtp_loss_scale``: the MTP loss weight
    of a forward that runs MTP, in place of the model's ``mtp_loss_scaling_factor``."""

    name = "loss_scale"
    keys = ("loss_scale",)
    given = decided = {"loss_scale": None}
    hook = "mtp_loss_scale"
    what, settle, show = "the MTP loss weight", "run:0.1", "g"

    def parse(
        self, table: Mapping[str, Any], where: str, value: str, parsed: Mapping[str, Any]
    ) -> dict[str, Any]:
        scale = table.get("loss_scale")
        if scale is None:
            return {"loss_scale": None}
        example = "loss_scale = 0.3 (a number, unquoted)"
        return {"loss_scale": check_loss_scale(scale, where, value, example)}

    def spell(self, entry: Options) -> str:
        return "" if entry.loss_scale is None else f":{entry.loss_scale!r}"

    def answer(self, plugin: str, raw: Any) -> Any:
        if raw is None:
            return None
        where = f"plugin {plugin!r}: mtp_loss_scale returned {reprlib.repr(raw)}"
        return check_loss_scale(raw, where)

    def decide(self, entry: Options | None, decision: Options, ask: Ask) -> dict[str, Any] | None:
        if entry is not None and entry.loss_scale is not None:
            return {"loss_scale": entry.loss_scale}
        scales = ask.answers(self)
        return {"loss_scale": next(iter(scales.values()))} if scales else None

    def plan(self, options: Options, implements: Callable[[str], bool]) -> PlanPart:
        if options.loss_scale is None:
            return NOTHING
        return PlanPart(changes=(("mtp_loss_scaling_factor", options.loss_scale),))

    def asked(self, options: Options, implements: Callable[[str], bool]) -> tuple[Asked, ...]:
        if options.loss_scale is None:
            return ()
        return (Asked("a loss weight (run:W or mtp_loss_scale)"),)

    def describe(self, options: Options, implementers: Callable[[str], list[str]]) -> list[str]:
        if options.loss_scale is None:
            return []
        return [f"loss scale: {options.loss_scale!r} (from {options.by(self.name)})"]


class Metrics(Flag):
    """``+metrics``: a forward that runs MTP with labels records MTP loss and top-1 acceptance
    per depth (the ``+metrics`` extension)."""

    name = "metrics"
    unset = False
    extension = "mtp_hooks.megatron.drafting._recorder:Recorder"

    def plan(self, options: Options, implements: Callable[[str], bool]) -> PlanPart:
        return PlanPart(extension=True) if options.metrics else NOTHING

    def describe(self, options: Options, implementers: Callable[[str], list[str]]) -> list[str]:
        return ["metrics: recorded (MTP loss and top-1 acceptance per depth)"] * options.metrics

    def refusal(self, options: Options, layout: Layout) -> str | None:
        if not options.metrics:
            return None
        if layout.replayed:
            return (
                "this model uses full-iteration CUDA graphs, which replay megatron's training "
                "and evaluate() iterations without running any forward hook, and '+metrics' "
                "records MTP figures in Python after each forward, which no replay runs. Drop "
                "'+metrics' there, or set cuda_graph_impl to 'local', 'transformer_engine' or "
                "'none'"
            )
        if layout.standalone:
            return (
                "this pipeline layout puts MTP on a stage of its own (config.mtp_standalone): "
                "the MTP stage has no output layer to measure the depths with, and the stage "
                "that computes the losses has no MTP block to hook. Drop '+metrics' there; "
                "megatron logs the training MTP loss itself ('mtp_1 loss')"
            )
        return None


class Detach(Flag):
    """``+detach`` (TOML ``detach = true``), or plugins' ``mtp_detach_heads``: MTP runs on
    detached trunk outputs, embeddings and output weight, so its loss trains only the MTP
    weights. TOML ``detach = false`` keeps the model's own ``mtp_detach_heads``, whatever
    plugins say."""

    name = "detach"
    hook = "mtp_detach_heads"
    what, settle = "detaching MTP", "run+detach"

    def note(self, entry: Options) -> str:
        return " (detach = false: the model's own)" if entry.detach is False else ""

    def answer(self, plugin: str, raw: Any) -> Any:
        return check_vote(plugin, "mtp_detach_heads", raw)

    def decide(self, entry: Options | None, decision: Options, ask: Ask) -> dict[str, Any] | None:
        if entry is not None and entry.detach is not None:
            return {"detach": True} if entry.detach else None  # false: the model's own
        if not any(ask.answers(self).values()):
            return None
        return {"detach": True}

    def plan(self, options: Options, implements: Callable[[str], bool]) -> PlanPart:
        if not options.detach:
            return NOTHING
        return PlanPart(changes=(("mtp_detach_heads", True),), into_layers=True)

    def describe(self, options: Options, implementers: Callable[[str], list[str]]) -> list[str]:
        if not options.detach:
            return []
        return [
            "detach: MTP trains on detached trunk outputs, embeddings and output weight "
            f"(from {options.by(self.name)})"
        ]


class Mask(Option):
    """``+mask:labels`` (TOML ``mask = "labels"``, with ``ignore_index``): the MTP loss also
    leaves out positions whose label is the ignore index; TOML ``plugin_masks = false`` turns
    plugins' ``mtp_loss_mask`` answers off. Both are applied by the loss-mask extension."""

    name = "mask"
    shown = "'+mask:labels'"
    choices = MASKS
    keys = ("mask", "ignore_index", "plugin_masks")
    given = {"mask": None, "ignore_index": None, "plugin_masks": None}
    decided = {"mask": None, "ignore_index": IGNORE_INDEX, "plugin_masks": True}
    plans_when_plain = True  # plugins' masks are asked unless the config turns them off
    extension = "mtp_hooks.megatron._loss_masking:LossMasks"

    def parse(
        self, table: Mapping[str, Any], where: str, value: str, parsed: Mapping[str, Any]
    ) -> dict[str, Any]:
        ignore = table.get("ignore_index")
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
        plugin_masks = boolean(table, "plugin_masks", where)
        return {"mask": mask, "ignore_index": ignore, "plugin_masks": plugin_masks}

    def spell(self, entry: Options) -> str:
        return "" if entry.mask is None else f"+mask:{entry.mask}"

    def note(self, entry: Options) -> str:
        note = "" if entry.ignore_index is None else f" (ignore_index = {entry.ignore_index})"
        return note + (" (plugin_masks = false)" if entry.plugin_masks is False else "")

    def decide(self, entry: Options | None, decision: Options, ask: Ask) -> dict[str, Any] | None:
        if entry is None or (entry.mask is None and entry.plugin_masks is not False):
            return None
        ignore = IGNORE_INDEX if entry.ignore_index is None else entry.ignore_index
        return {
            "mask": entry.mask,
            "ignore_index": ignore,
            "plugin_masks": entry.plugin_masks is not False,
        }

    @staticmethod
    def ignored(options: Options) -> int | None:
        """The label a call under ``options`` leaves out of the MTP loss, or ``None``."""
        return options.ignore_index if options.mask == "labels" else None

    @staticmethod
    def plugins_asked(options: Options, implements: Callable[[str], bool]) -> bool:
        """Whether a call under ``options`` asks plugins' ``mtp_loss_mask``."""
        return bool(options.plugin_masks) and implements("mtp_loss_mask")

    def plan(self, options: Options, implements: Callable[[str], bool]) -> PlanPart:
        masking = self.ignored(options) is not None or self.plugins_asked(options, implements)
        return PlanPart(extension=True) if masking else NOTHING

    def asked(self, options: Options, implements: Callable[[str], bool]) -> tuple[Asked, ...]:
        asked: tuple[Asked, ...] = ()
        if self.ignored(options) is not None:
            asked += (Asked("+mask:labels"),)
        if self.plugins_asked(options, implements):
            asked += (Asked("plugins' mtp_loss_mask answers", needs_a_run=False),)
        return asked

    def describe(self, options: Options, implementers: Callable[[str], list[str]]) -> list[str]:
        masks = []
        if options.mask == "labels":
            masks.append(f"labels other than {options.ignore_index} (from config)")
        plugins = implementers("mtp_loss_mask")  # asked at the forward
        if options.plugin_masks and plugins:
            masks.append("plugins " + ", ".join(plugins))
        elif plugins:
            masks.append("plugins' masks off (from config)")
        if not masks:
            return []
        return ["MTP loss mask: " + "; ".join(masks) + ", with the caller's loss_mask"]


class Objective(Option):
    """``+objective:kl`` or ``:tv`` (TOML ``objective``, with ``temperature``), or plugins'
    ``mtp_objective``: MTP's loss trains toward the policy's own next-token distribution
    (self-distillation) instead of megatron's cross-entropy against the labels (``ce``).
    ``kl`` and ``tv`` need ``+detach``: the trunk must never learn from its own drafter's
    target. Megatron's own weight is 0 for the call, and the objective extension adds the
    objective at the option's loss weight."""

    name = "objective"
    shown = "'+objective:kl' (or ':tv', ':ce')"
    choices = OBJECTIVES
    keys = ("objective", "temperature")
    given = {"objective": None, "temperature": None}
    decided = {"objective": None, "temperature": 1.0}
    hook = "mtp_objective"
    what, settle = "the MTP objective", "run+detach+objective:kl"
    extension = "mtp_hooks.megatron.drafting._objectives:Objectives"

    def parse(
        self, table: Mapping[str, Any], where: str, value: str, parsed: Mapping[str, Any]
    ) -> dict[str, Any]:
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
                f"{where}: unknown MTP objective {raw!r}{hint}; the objectives are 'ce' "
                "(megatron's cross-entropy against the labels), 'kl' (the policy's own "
                "next-token distribution) and 'tv' (the total variation to it)"
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
            raise PolicyError(
                f"{where}: 'temperature' must be finite and above 0, not {temperature!r}"
            )
        return {"objective": name, "temperature": float(temperature)}

    def spell(self, entry: Options) -> str:
        return "" if entry.objective is None else f"+objective:{entry.objective}"

    def note(self, entry: Options) -> str:
        return "" if entry.temperature is None else f" (temperature = {entry.temperature!r})"

    def answer(self, plugin: str, raw: Any) -> Any:
        return check_objective(plugin, raw)

    def decide(self, entry: Options | None, decision: Options, ask: Ask) -> dict[str, Any] | None:
        if entry is not None and entry.objective is not None:
            if entry.objective == "ce":
                return None
            temperature = 1.0 if entry.temperature is None else entry.temperature
            return {"objective": entry.objective, "temperature": temperature}
        answers = ask.answers(self)  # an answer may follow the policy's entropy
        objective = next(iter(answers.values()), "ce")
        if objective == "ce":
            return None
        if not decision.detach:
            names = ",".join(answers)
            raise PolicyError(
                plugin=names,
                hook="mtp_objective",
                option=f"+objective:{objective}",
                message=f"plugin {names} asks MTP to train toward the policy's own "
                f"distribution (objective {objective!r}) in phase {str(ask.phase)!r}, which "
                "must never train the trunk, but this forward is not detached. Detach it (the "
                "policy's '+detach', or a plugin's mtp_detach_heads), or answer 'ce'",
            )
        return {"objective": objective}

    def plan(self, options: Options, implements: Callable[[str], bool]) -> PlanPart:
        if options.objective is None:
            return NOTHING
        # megatron's cross-entropy adds nothing: the extension adds the objective instead
        return PlanPart(changes=(("mtp_loss_scaling_factor", 0.0),), extension=True)

    def asked(self, options: Options, implements: Callable[[str], bool]) -> tuple[Asked, ...]:
        return () if options.objective is None else (Asked("+objective"),)

    def describe(self, options: Options, implementers: Callable[[str], list[str]]) -> list[str]:
        if options.objective is None:
            return []
        return [
            f"objective: {options.objective} against the policy's own next-token "
            f"distribution at temperature {options.temperature:g}, from "
            f"{options.by(self.name)} (megatron's cross-entropy still runs, at weight 0)"
        ]

    def refusal(self, options: Options, layout: Layout) -> str | None:
        if options.objective in (None, "ce"):  # an entry's "ce" is megatron's own loss
            return None
        if layout.replayed:
            return (
                "this model uses full-iteration CUDA graphs, whose replays run no Python, and "
                "the objective is computed in a forward hook. Use cuda_graph_impl="
                "'transformer_engine' or 'none', or objective 'ce'"
            )
        if layout.standalone:
            return (
                "this model computes MTP on a pipeline stage of its own, where the policy's "
                "logits it trains toward do not exist. Put MTP on the last stage, or use "
                "objective 'ce'"
            )
        return None


OPTIONS: Final[tuple[Option, ...]] = (LossScale(), Metrics(), Detach(), Mask(), Objective())
"""The built-in policy options (:func:`options` adds the contributed ones after them), in the
order the parser checks them, decisions take them and messages list them: an option may read
the fields of those before it (``objective`` reads ``detach``). Later options' config changes
win over earlier ones' (an objective's weight 0 over ``run:W``)."""


def options() -> tuple[Option, ...]:
    """Every policy option in force: :data:`OPTIONS`, then those installed distributions
    contribute (:mod:`._contributed_options`), loaded at the first call of this runtime (the
    first parse or decision) and kept until :func:`mtp_hooks.testing.reset`.

    Raises:
        PluginError: A contributed option does not load or clashes with another; the message
            names its distribution and the fix, and no contributed option is loaded.
    """
    runtime = _runtime.current
    found: tuple[Option, ...] | None = runtime.options
    if found is None:
        found = runtime.options = OPTIONS + _contributed_options.load(OPTIONS)
    return found


def reraise(option: Option, method: str, exc: Exception) -> NoReturn:
    """Raise ``exc``, which ``option``'s ``method`` raised, named for whoever must fix it.

    mtp-hooks' own errors (a policy an option refuses, a plugin's answer) and the built-in
    options' failures are raised as they are. Anything else a contributed option raises becomes
    a :class:`~mtp_hooks.PluginError` that names the option's distribution, with ``exc`` as its
    cause. The callers catch around their whole loop over the options, so the hot path pays
    no handler per option.
    """
    if isinstance(exc, MTPHooksError) or any(option is own for own in OPTIONS):
        raise exc
    raise _contributed_options.raised(option.name, method, exc)


def each(method: str, call: Callable[[Option], T]) -> list[T]:
    """``call(option)`` for every option in force, in order, where ``call`` calls the option's
    ``method``; what an option raises is named as :func:`reraise` names it."""
    found, in_force = [], options()
    try:
        for option in in_force:
            found.append(call(option))
    except Exception as exc:
        reraise(option, method, exc)
    return found


def entry_options(fields: Mapping[str, Any] | None = None) -> Options:
    """An entry's options: ``fields`` over every option's unset values."""
    unset = {name: value for option in options() for name, value in option.given.items()}
    return Options({**unset, **(fields or {})})


_plain: list[Any] = [None, None]  # (the options it was made of, their plain Options)


def plain() -> Options:
    """A decision's and a plan's options in a plain run or skip (made once per set of
    :func:`options`: a decision asked of plugins at every forward starts from it)."""
    in_force = options()
    if _plain[0] is not in_force:
        _plain[:] = in_force, Options({n: v for o in in_force for n, v in o.decided.items()})
    made: Options = _plain[1]
    return made

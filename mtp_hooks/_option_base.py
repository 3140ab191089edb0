"""What a policy option is (:class:`Option`, :class:`Flag`), and the records that carry the
options' values and effects: :class:`Options` (an entry's, a decision's or a plan's values, read
by field name as pytest's ``config.option`` is), :class:`PlanPart` (what an option changes in a
phase's plan), :class:`Asked` (what a plan asks, as refusals name it) and :class:`Layout` (how
a model runs, where an option may be unable to follow it). The options themselves are in
:mod:`mtp_hooks._options`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar, Final

from ._errors import PolicyConflictError, PolicyError, about
from ._policy_errors import did_you_mean


class Options:
    """Each policy option's fields for one policy entry, decision or plan, and who set them.

    Read a field as an attribute (``options.loss_scale``, ``options.detach``); the fields are
    those the policy options declare (:attr:`mtp_hooks.Decision.options` lists a decision's).
    Immutable, hashable and picklable; decisions share it. A field no option declares is an
    ``AttributeError`` that names the fields.

    Example:
        >>> import mtp_hooks
        >>> mtp_hooks.configure("train=run:0.3+detach")
        >>> options = mtp_hooks.decide(None, "train").options
        >>> options.loss_scale, options.detach, options.by("detach")
        (0.3, True, 'config')
    """

    # the fields are instance attributes, so that reading one costs what reading any attribute
    # does (a plan reads several at every forward where a plugin is asked at every forward);
    # __getattr__ is only reached by a name no option declares
    _fields: tuple[str, ...]
    _by: Mapping[str, str]

    def __init__(self, fields: Mapping[str, Any], by: Mapping[str, str] | None = None) -> None:
        given = self.__dict__
        given.update(fields)
        given["_fields"], given["_by"] = tuple(fields), dict(by or {})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # copy and pickle probe dunders on a bare instance
            raise AttributeError(name)
        hint = did_you_mean(name, list(self._fields))
        raise AttributeError(
            f"no policy option field {name!r}{hint}; the fields are {', '.join(self._fields)}"
        )

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Options are immutable; decisions and plans share them")

    def by(self, option: str) -> str | None:
        """Who set ``option`` (an option's name): ``"config"``, the plugins' names joined by
        commas, or ``None`` where it was not set."""
        return self._by.get(option)

    def fields(self) -> dict[str, Any]:
        """Every field and its value, in the options' order."""
        return {name: self.__dict__[name] for name in self._fields}

    def with_fields(self, fields: Mapping[str, Any], option: str, by: str) -> Options:
        """These options with ``fields`` of ``option`` set, by ``by``."""
        return Options({**self.fields(), **fields}, {**self._by, option: by})

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Options):
            return NotImplemented
        return self.fields() == other.fields() and self._by == other._by

    def __hash__(self) -> int:
        return hash((tuple(self.fields().items()), tuple(sorted(self._by.items()))))

    def __repr__(self) -> str:
        by = f", by={self._by!r}" if self._by else ""
        return f"Options({self.fields()!r}{by})"

    def __reduce__(self) -> tuple[Any, ...]:
        return Options, (self.fields(), self._by)


@dataclass(frozen=True, slots=True)
class PlanPart:
    """What one option changes in a phase's plan, for a call that runs MTP.

    Attributes:
        changes: The model config fields a call changes, and their values (megatron reads the
            MTP loss weight and ``mtp_detach_heads`` from its config at forward time). Default
            none.
        into_layers: Whether the changes also reach the MTP block's and layers' own configs,
            which some fields are read from (``mtp_detach_heads``). Default ``False``.
        extension: Whether a call begins the option's per-call extension. Default ``False``.
    """

    changes: tuple[tuple[str, Any], ...] = ()
    into_layers: bool = False
    extension: bool = False


NOTHING: Final = PlanPart()


@dataclass(frozen=True, slots=True)
class Asked:
    """One thing a plan asks beyond a plain run or skip, as a refusal names it.

    Attributes:
        says: How a refusal names it (``"+detach"``).
        needs_a_run: Whether a call that does not run MTP leaves it undone (plugins' masks only
            weigh a loss that is computed: nothing is lost without one). Default ``True``.
    """

    says: str
    needs_a_run: bool = True


@dataclass(frozen=True, slots=True)
class Layout:
    """How a model runs a phase's forwards, where an option may be unable to do its part
    (:meth:`Option.refusal`). The adapters make it from the model at attach.

    Attributes:
        replayed: The phase's forwards are replayed from megatron's full-iteration CUDA graphs
            (training and ``evaluate()``), which run no Python: no forward hook runs, so no
            per-call extension begins, records or adds a loss. Default ``False``.
        standalone: MTP runs on a pipeline stage of its own (``config.mtp_standalone``): that
            stage has no output layer, and the stage that computes the losses has no MTP
            block. Default ``False``.

    Example:
        >>> from mtp_hooks.plugins import Layout
        >>> Layout(replayed=True).plain, Layout().plain
        (False, True)
    """

    replayed: bool = False
    standalone: bool = False

    @property
    def plain(self) -> bool:
        """Whether every forward runs eagerly with MTP on the last stage: nothing keeps an
        option from its part, so the adapters ask no option about it."""
        return not (self.replayed or self.standalone)


class Ask:
    """What an option's :meth:`Option.decide` may ask: the plugins' answers to its hook, and
    the phase and role it decides for. Knows whether it asked (an answer asked at every
    forward may follow the step, so the decision is not cached) and who answered (``by``)."""

    __slots__ = ("_call", "_implements", "asked", "by", "phase", "role")

    def __init__(
        self,
        call: Callable[[str], list[tuple[str, Any]]],
        implements: Callable[[str], bool],
        phase: Any,
        role: str | None,
    ) -> None:
        self._call, self._implements = call, implements
        self.phase, self.role = phase, role
        self.asked, self.by = False, ""

    def answers(self, option: Option) -> dict[str, Any]:
        """Each plugin's checked answer to ``option``'s hook by name, abstentions left out,
        once they all agree; else a :class:`~mtp_hooks.PolicyConflictError` listing each."""
        assert option.hook is not None
        if not self._implements(option.hook):
            return {}
        self.asked = True
        answers = []
        for name, raw in self._call(option.hook):
            with about(plugin=name, hook=option.hook):
                answer = option.answer(name, raw)
            if answer is not None:
                answers.append((name, answer))
        by_name = dict(sorted(answers))
        if len(set(by_name.values())) > 1:
            listed = ", ".join(f"{name}={a:{option.show}}" for name, a in by_name.items())
            error = PolicyConflictError(
                conflict(option.what, self.role, str(self.phase), listed, option.settle),
                hook=option.hook,
            )
            error.answers = dict(by_name)  # a record to read, and to pickle
            raise error
        self.by = ",".join(by_name)
        return by_name


def conflict(
    what: str, role: str | None, phase: str, listed: str, settle: str, or_settle: str = ""
) -> str:
    """The message of a :class:`~mtp_hooks.PolicyConflictError`: who said what, and how to
    settle it in the policy config (``or_settle``: the value the variable's example shows,
    where it differs)."""
    key = f"{role}.{phase}" if role else phase
    return (
        f"plugins disagree on {what} for phase {phase!r}"
        + (f" and role {role!r}" if role else "")
        + f": {listed}. Settle it in the policy config, e.g. "
        f"mtp_hooks.configure('{key}={settle}') or MTP_HOOKS_POLICY={key}={or_settle or settle}."
    )


def needs_a_run(option: str, flag: object, where: str, value: str) -> None:
    """Refuse an option given with ``skip``: it needs MTP to run."""
    if flag and value == "skip":
        raise PolicyError(
            option=f"+{option}",
            message=f"{where}: '+{option}' needs MTP to run; write 'run+{option}' (or "
            f"'auto+{option}' to let the plugins decide), or drop '+{option}'",
        )


def boolean(table: Mapping[str, Any], key: str, where: str) -> bool | None:
    """A table's ``true``/``false`` key, or ``None`` where it is not given."""
    flag = table.get(key)
    if flag is not None and not isinstance(flag, bool):
        raise PolicyError(f"{where}: {key!r} is true or false, not {flag!r}", option=key)
    return flag


class Option:
    """One policy option. Subclass it, set the class attributes, override what it does.

    The defaults describe a flag that only the config sets and that changes nothing in the
    plan; :class:`Flag` is such a ``+name`` flag ready to use.
    """

    name: ClassVar[str]
    """Its name: the word after ``+`` in a policy string, and its TOML key."""
    shown: ClassVar[str] = ""
    """How the parser's messages list it (``"'+mask:labels'"``); empty for the loss weight,
    which is part of the value (``run:0.3``), not a ``+`` option."""
    choices: ClassVar[tuple[str, ...]] = ()
    """The names a ``+name:NAME`` option takes (``+objective:kl``); empty for a flag."""
    keys: ClassVar[tuple[str, ...]]
    """The TOML table keys it reads: its own name and the keys only it takes."""
    given: ClassVar[Mapping[str, Any]]
    """Its fields in a policy entry, and their values where it is not given."""
    decided: ClassVar[Mapping[str, Any]]
    """Its fields in a decision and a plan, and their values in a plain run or skip."""
    hook: ClassVar[str | None] = None
    """The plugin hook whose answers set it where the config does not (``mtp_detach_heads``
    for ``detach``), or ``None``: only the config sets it. A decision asks an option only
    where the config names the phase or a plugin implements this hook."""
    what: ClassVar[str] = ""
    """How a conflict between plugins' answers names it (``"detaching MTP"``)."""
    settle: ClassVar[str] = ""
    """The policy value a conflict suggests to settle it (``"run+detach"``)."""
    show: ClassVar[str] = ""
    """The format spec of an answer in a conflict's message (``"g"`` for a weight)."""
    plans_when_plain: ClassVar[bool] = False
    """Whether :meth:`plan` may change a plan whose options are all plain (plugins' loss masks
    are asked by default); where it may not, a plain plan does not ask it. Default ``False``."""
    hookspecs: ClassVar[ModuleType | type | None] = None
    """A module or class whose :data:`mtp_hooks.plugins.hookspec`-marked functions declare the
    hooks it asks (:attr:`hook`), where they are not mtp-hooks' own: the plugin registry adds
    them, so that plugins may implement them. Default ``None``."""
    extension: ClassVar[str] = ""
    """Where the adapters find its per-call extension kind, as ``"module:Class"``
    (``"mtp_hooks.megatron._loss_masking:LossMasks"``), for a plan part that asks for one
    (:attr:`PlanPart.extension`); empty: it never asks. A name, not the class, since the
    adapters stand above the options and import torch: the first plan that asks imports it."""

    @property
    def spellings(self) -> tuple[str, ...]:
        """Every way it is written after a ``+`` (``detach``, ``objective:kl`` ...)."""
        if not self.shown:
            return ()
        return tuple(f"{self.name}:{c}" for c in self.choices) or (self.name,)

    def parse(
        self, table: Mapping[str, Any], where: str, value: str, parsed: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Its entry fields (:attr:`given`) from ``table`` (a string's options read into
        one), for the entry of ``value`` (``run``, ``skip`` or ``auto``) at ``where``;
        ``parsed`` holds the fields of the options before it.

        Raises:
            PolicyError: A key of its own is given wrong; the message names ``where``.
        """
        raise NotImplementedError

    def spell(self, entry: Options) -> str:
        """Its part of an entry's compact spelling (``"+detach"``), ``""`` when unset."""
        return ""

    def note(self, entry: Options) -> str:
        """What ``check-config`` adds after the spelling for what has no compact spelling
        (``" (detach = false: the model's own)"``), else ``""``."""
        return ""

    def answer(self, plugin: str, raw: Any) -> Any:
        """A plugin's answer to :attr:`hook`, checked; ``None``: it abstains.

        Raises:
            PolicyError: The answer is not one the hook allows; the message names the plugin.
        """
        return raw

    def decide(self, entry: Options | None, decision: Options, ask: Ask) -> dict[str, Any] | None:
        """Its decision fields for a forward that runs MTP, from the policy entry (``None``:
        the config names none for this model and phase) or the plugins, or ``None`` to keep
        the plain values. ``decision`` holds what the options before it decided.

        Returns:
            The fields, or ``None``. Who set them is ``"config"`` unless ``ask`` was asked.
        """
        return None

    def plan(self, options: Options, implements: Callable[[str], bool]) -> PlanPart:
        """What it changes in the plan of a call that runs MTP under ``options`` (a
        decision's); ``implements(hook)`` says whether a plugin implements a hook."""
        return NOTHING

    def asked(self, options: Options, implements: Callable[[str], bool]) -> tuple[Asked, ...]:
        """What it asks beyond a plain run under ``options``, as refusals name it."""
        return ()

    def describe(self, options: Options, implementers: Callable[[str], list[str]]) -> list[str]:
        """Its lines of ``mtp-hooks explain`` for a decision that runs MTP."""
        return []

    def refusal(self, options: Options, layout: Layout) -> str | None:
        """Why a call under ``options`` cannot have this option's part on a model that runs
        as ``layout``, ending in the fix; ``None`` where it can (the default).

        ``options`` is a policy entry's (asked when a model is attached and whenever the
        policy changes, so that a config the model cannot follow is refused before the first
        step) or a decision's (asked when a call's plan is made, for what plugins set). Only a
        layout that is not :attr:`Layout.plain` is asked about. The adapters raise
        :class:`~mtp_hooks.UnsupportedModelError` with it, after naming the phase and who
        asked, so it reads after "but": ``"this model ..., which ... Drop '+name' there, or
        ..."``.
        """
        return None


class Flag(Option):
    """A ``+name`` flag (TOML ``name = true``) that needs MTP to run and that only the config
    sets; its entry and decision field are both ``name``. Set :attr:`name`, and override
    :meth:`plan` and :meth:`describe` for what it does."""

    unset: ClassVar[bool | None] = None
    """The entry field where the flag is not given: ``None`` lets plugins decide (``detach``);
    ``False`` where only the config sets it. Default ``None``."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.shown, cls.keys = f"'+{cls.name}'", (cls.name,)
        cls.given, cls.decided = {cls.name: cls.unset}, {cls.name: False}

    def parse(
        self, table: Mapping[str, Any], where: str, value: str, parsed: Mapping[str, Any]
    ) -> dict[str, Any]:
        flag = boolean(table, self.name, where)
        needs_a_run(self.name, flag, where, value)
        return {self.name: self.unset if flag is None else flag}

    def spell(self, entry: Options) -> str:
        return f"+{self.name}" if getattr(entry, self.name) else ""

    def decide(self, entry: Options | None, decision: Options, ask: Ask) -> dict[str, Any] | None:
        return {self.name: True} if entry is not None and getattr(entry, self.name) else None

    def asked(self, options: Options, implements: Callable[[str], bool]) -> tuple[Asked, ...]:
        return (Asked(f"+{self.name}"),) if getattr(options, self.name) else ()

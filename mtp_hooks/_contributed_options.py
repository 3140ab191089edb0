"""Policy options that installed distributions contribute: the ``mtp_hooks.options`` entry-point
group, loaded all or nothing the first time a policy is parsed or a decision made.

An entry point names an :class:`~mtp_hooks._option_base.Option` subclass (or instance); its name
is the option's. A contributed option comes after the built-in ones, in entry-point name order,
so the built-ins never read its fields. Loading one changes no job by itself: it adds a word to
the policy's grammar (``+name``), and only a policy that writes the word asks it anything.

Each option is checked before any is used: an option must not take another's name, table key,
``+`` spelling or field, since the parser and the records find them by those, nor a hook that
is declared already; and a hook it asks must be declared (by mtp-hooks or by its
:attr:`~mtp_hooks._option_base.Option.hookspecs`). A failure names the entry point, its
distribution and the fix, and no contributed option is loaded.
"""

from __future__ import annotations

import importlib.metadata
import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType

import pluggy

from . import _env, hookspecs
from ._errors import PluginError
from ._option_base import Option

GROUP = "mtp_hooks.options"
"""The entry-point group of contributed policy options."""


def load(built_in: tuple[Option, ...]) -> tuple[Option, ...]:
    """The options the installed distributions contribute, checked against ``built_in`` and
    each other, less those :data:`~mtp_hooks._env.ENV_DISABLE` names.

    :data:`~mtp_hooks._env.ENV_DISABLE_AUTOLOAD` does not keep them out: it keeps out plugins,
    which vote in every job, where an option is a word that acts only in a policy that writes
    it, and a job that registers its plugins by hand needs the options' hooks declared.

    Raises:
        PluginError: An entry point does not load, names no option, or its option takes a
            name, key, spelling, field or hook another option has, or asks a hook nobody
            declares; the message names the fix.
    """
    blocked = set(_env.blocked_names())
    found = sorted(
        (ep for ep in importlib.metadata.entry_points(group=GROUP) if ep.name not in blocked),
        key=lambda ep: ep.name,
    )
    contributed: list[Option] = []
    for ep in found:
        option = _option_of(ep)
        _check_apart(option, [*built_in, *contributed], ep)
        _check_hooks(option, [*built_in, *contributed], ep)
        contributed.append(option)
    return tuple(contributed)


@dataclass(frozen=True, slots=True)
class OptionInfo:
    """What ``mtp-hooks options`` reports for one policy option.

    Attributes:
        name: The option's name.
        written: How a policy string writes it (``"+objective:kl"``, ...; ``"run:WEIGHT"`` for
            the loss weight, which is part of the value).
        keys: The TOML table keys it reads.
        hook: The plugin hook whose answers set it where the config does not, or ``None``.
        distribution: The distribution that contributes it, ``None`` for mtp-hooks' own.
        version: That distribution's version, ``None`` for mtp-hooks' own.
    """

    name: str
    written: tuple[str, ...]
    keys: tuple[str, ...]
    hook: str | None
    distribution: str | None = None
    version: str | None = None


def describe(options: Iterable[Option], built_in: Iterable[Option]) -> list[OptionInfo]:
    """Each of ``options`` as ``mtp-hooks options`` reports it, in the parser's order; the
    distribution of each that is not in ``built_in``."""
    own = {option.name for option in built_in}
    origins = {ep.name: distribution_of(ep) for ep in importlib.metadata.entry_points(group=GROUP)}
    infos = []
    for option in options:
        written = tuple(f"+{spelling}" for spelling in option.spellings) or ("run:WEIGHT",)
        dist, version = (None, None) if option.name in own else origins.get(option.name, ("?", "?"))
        infos.append(
            OptionInfo(option.name, written, tuple(option.keys), option.hook, dist, version)
        )
    return infos


def left_out(name: str) -> str:
    """Where the option ``name`` is an installed distribution's that the environment keeps out,
    a message's hint saying so and how to let it in; else ``""``."""
    if name not in _env.blocked_names():
        return ""
    for ep in importlib.metadata.entry_points(group=GROUP):
        if ep.name == name:
            why = f"{_env.ENV_DISABLE} names it; take it out of the list"
            return f" ({_origin(ep)} is installed but not loaded: {why})"
    return ""


def hook_names(declared_in: ModuleType | type) -> list[str]:
    """The hooks a module or class declares with :data:`mtp_hooks.plugins.hookspec`, in the
    order it declares them."""
    reader = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    return [
        name
        for name in vars(declared_in)
        if not name.startswith("_") and reader.parse_hookspec_opts(declared_in, name) is not None
    ]


def distribution_of(ep: importlib.metadata.EntryPoint) -> tuple[str | None, str | None]:
    """The name and version of the distribution an entry point comes from (``None`` each where
    its metadata does not say)."""
    dist = getattr(ep, "dist", None)
    return (dist.metadata["Name"], dist.version) if dist is not None else (None, None)


def raised(name: str, method: str, exc: Exception) -> PluginError:
    """The error for the contributed option ``name`` whose ``method`` raised ``exc`` (not one
    of mtp-hooks' errors, which name their culprit already): it names the option's
    distribution, the method and how to keep the option out."""
    found = [ep for ep in importlib.metadata.entry_points(group=GROUP) if ep.name == name]
    origin = _origin(found[0]) if found else f"policy option {name!r}"
    fix = _fix(found[0]) if found else f"Fix it, or disable it with {_env.ENV_DISABLE}={name}."
    error = PluginError(
        plugin=name,
        message=f"{origin}: its {method} raised {type(exc).__name__}: {exc}. {fix}",
    )
    error.__cause__ = exc
    return error


def _origin(ep: importlib.metadata.EntryPoint) -> str:
    name, version = distribution_of(ep)
    return (
        f"policy option {ep.name!r} (entry point {ep.value!r} of distribution {name or '?'} "
        f"{version or '?'})"
    )


def _fix(ep: importlib.metadata.EntryPoint) -> str:
    return f"Fix or uninstall it, or disable it with {_env.ENV_DISABLE}={ep.name}."


def _option_of(ep: importlib.metadata.EntryPoint) -> Option:
    try:
        loaded = ep.load()
        option = loaded() if inspect.isclass(loaded) and issubclass(loaded, Option) else loaded
    except Exception as exc:
        raise PluginError(
            plugin=ep.name,
            message=f"{_origin(ep)} failed to load: {type(exc).__name__}: {exc}. {_fix(ep)}",
        ) from exc
    if not isinstance(option, Option):
        raise PluginError(
            plugin=ep.name,
            message=f"{_origin(ep)} names {loaded!r}, which is not a subclass of "
            f"mtp_hooks.plugins.Option. Point the entry point at the option's class. {_fix(ep)}",
        )
    missing = [
        attribute
        for attribute in ("name", "keys", "given", "decided")
        if not hasattr(option, attribute)
    ]
    if missing:
        raise PluginError(
            plugin=ep.name,
            message=f"{_origin(ep)} does not set {', '.join(missing)}, which every option "
            f"declares (mtp_hooks.plugins.Flag sets all but the name). {_fix(ep)}",
        )
    if option.name != ep.name:
        raise PluginError(
            plugin=ep.name,
            message=f"{_origin(ep)} names an option called {option.name!r}; "
            f"the entry point's name is the option's name. Name them alike. {_fix(ep)}",
        )
    return option


def _check_apart(
    option: Option, others: Iterable[Option], ep: importlib.metadata.EntryPoint
) -> None:
    """Refuse ``option`` where it takes what another option, or the ``mtp`` key, has."""
    if "mtp" in option.keys:
        raise PluginError(
            plugin=ep.name,
            message=f"{_origin(ep)} takes the table key 'mtp', which says run, skip or auto in "
            f"every policy table. Rename the option's key. {_fix(ep)}",
        )
    for other in others:
        for what, mine, theirs in (
            ("name", {option.name}, {other.name}),
            ("table key", set(option.keys), set(other.keys)),
            ("'+' spelling", set(option.spellings), set(other.spellings)),
            ("field", {*option.given, *option.decided}, {*other.given, *other.decided}),
        ):
            shared = sorted(mine & theirs)
            if shared:
                raise PluginError(
                    plugin=ep.name,
                    message=f"{_origin(ep)} takes the {what} {shared[0]!r}, which policy "
                    f"option {other.name!r} has already; a policy could not say which it "
                    f"means. Rename the option's {what}. {_fix(ep)}",
                )


def _check_hooks(
    option: Option, others: Iterable[Option], ep: importlib.metadata.EntryPoint
) -> None:
    """Refuse ``option`` where its hooks clash with declared ones, or its :attr:`hook` is
    declared nowhere (no plugin could answer it)."""
    declared = dict.fromkeys(hook_names(hookspecs), "mtp-hooks")
    for other in others:
        if other.hookspecs is not None:
            declared.update(dict.fromkeys(hook_names(other.hookspecs), f"option {other.name!r}"))
    own = hook_names(option.hookspecs) if option.hookspecs is not None else []
    for name in own:
        if name in declared:
            raise PluginError(
                plugin=ep.name,
                message=f"{_origin(ep)} declares the hook {name!r}, which {declared[name]} "
                f"declares already. Rename the option's hook. {_fix(ep)}",
            )
    if option.hook is not None and option.hook not in declared and option.hook not in own:
        raise PluginError(
            plugin=ep.name,
            message=f"{_origin(ep)} asks the hook {option.hook!r}, which no hookspec declares. "
            f"Declare it with mtp_hooks.plugins.hookspec in a module or class and set the "
            f"option's hookspecs to it. {_fix(ep)}",
        )

"""The ``mtp-hooks`` command line: ``plugins``, ``options``, ``explain``, ``check-config`` and
``demo``.

Errors print one line, ``mtp-hooks: error: ...``, and exit with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from . import _explain, _policy, _policy_entry, _roles, plugins
from ._errors import MTPHooksError, PolicyError

__all__ = ["main"]


class _RoleOnly:
    """A stand-in model that carries only a role, for ``explain --role``."""


def _cmd_plugins(args: argparse.Namespace) -> int:
    infos = plugins.list_plugins()
    if args.json:
        print(json.dumps([dataclasses.asdict(i) for i in infos], indent=2))
        return 0
    if not infos:
        print("no mtp_hooks plugins registered")
    for info in infos:
        dist = f"{info.distribution} {info.version}" if info.distribution else "(not installed)"
        state = "BLOCKED" if info.blocked else ", ".join(info.hooks) or "no hooks"
        print(f"{info.name:30} {dist:40} {state}")
    return 0


def _cmd_options(args: argparse.Namespace) -> int:
    infos = plugins.list_options()
    if args.json:
        print(json.dumps([dataclasses.asdict(i) for i in infos], indent=2))
        return 0
    for info in infos:
        # '+objective:ce|kl|tv': the choices of one option after its name, once
        head, _, _ = info.written[0].partition(":")
        choices = [spelling.partition(":")[2] for spelling in info.written]
        written = f"{head}:{'|'.join(choices)}" if len(choices) > 1 else info.written[0]
        source = f"{info.distribution} {info.version}" if info.distribution else "mtp-hooks"
        print(f"{written:22} {', '.join(info.keys):34} {info.hook or '-':18} {source}")
    return 0


def _cmd_explain(args: argparse.Namespace) -> int:
    if args.policy is not None:  # this process only, instead of the environment's sources
        from . import _sources

        _sources.use_only(args.policy, "--policy")
    model = None
    if args.role:
        model = _RoleOnly()
        _roles.set_role(model, args.role)
    print(_explain.explain(model, args.phase))
    return 0


def _cmd_check_config(args: argparse.Namespace) -> int:
    if args.file is not None and args.policy is not None:
        raise PolicyError(
            "check-config takes a TOML file or --policy STRING (the compact grammar of "
            "configure() and MTP_HOOKS_POLICY), one of the two"
        )
    checks: list[tuple[str, Callable[[], dict[Any, Any]]]]
    if args.policy is not None:
        checks = [
            (f"policy {args.policy!r}", lambda: _policy.parse_policy(args.policy, "--policy"))
        ]
    elif args.file is not None:
        # named as given: the file did not come from MTP_HOOKS_CONFIG
        checks = [(args.file, lambda: _policy.load_policy_file(args.file, origin=None))]
    else:  # what a job started from this shell would run with
        checks = _environment_checks()
    refused = 0
    for what, parse in checks:
        entries = parse()
        _print_entries(entries)
        print(f"{what}: valid ({len(entries)} {'entry' if len(entries) == 1 else 'entries'})")
        refusal = _installed_megatron_refusal(entries)
        if refusal is not None:
            print(f"{what}: {refusal}", file=sys.stderr)
            refused = 1
    return refused


def _installed_megatron_refusal(entries: dict[Any, Any]) -> str | None:
    """What the megatron-core installed here would refuse of ``entries`` at attach (``None``:
    nothing). The grammar is the same on every megatron-core; ``+detach`` (and the
    ``+objective:kl``/``tv`` that need it) is not."""
    import importlib.util

    detaching = sorted(
        f"{role + '.' if role else ''}{phase}"
        for (role, phase), e in entries.items()
        if e.options.detach
    )
    if not detaching:
        return None
    if importlib.util.find_spec("megatron") is None:
        print(
            f"{', '.join(detaching)}: +detach not checked against a megatron-core, as none is "
            "installed here (it needs megatron-core 0.19 or later)",
            file=sys.stderr,
        )
        return None
    from megatron.core.transformer.transformer_config import TransformerConfig

    from .megatron import _refusals

    # attach's own reason, for any model of this megatron-core (graphs aside: a file has none)
    reason = _refusals.detach_refusal(TransformerConfig, graphs=None)
    if reason is None:
        return None
    try:
        from megatron.core.package_info import __version__ as version
    except ImportError:
        version = "of this environment"
    return (
        f"{', '.join(detaching)}: +detach (and +objective:kl or tv, which need it) will be "
        f"refused at attach by the installed megatron-core {version}: {reason}"
    )


def _environment_checks() -> list[tuple[str, Callable[[], dict[Any, Any]]]]:
    """The policy sources the environment sets, each as the job would read it."""
    import os

    from ._sources import ENV_POLICY

    checks: list[tuple[str, Callable[[], dict[Any, Any]]]] = []
    policy = os.environ.get(ENV_POLICY)
    if policy:
        source = f"{ENV_POLICY}={policy!r}"
        checks.append((source, lambda: _policy.parse_policy(policy, source)))
    path = os.environ.get(_policy.ENV_CONFIG)
    if path:
        checks.append(
            (f"{_policy.ENV_CONFIG} file {path!r}", lambda: _policy.load_policy_file(path))
        )
    if not checks:
        raise PolicyError(
            "check-config: nothing to check; give a TOML file or --policy STRING, or set "
            f"{ENV_POLICY} or {_policy.ENV_CONFIG} (with neither argument it checks those)"
        )
    return checks


def _print_entries(entries: dict[Any, Any]) -> None:
    for (role, phase), entry in sorted(entries.items(), key=lambda kv: (kv[0][0] or "", kv[0][1])):
        spelled = _policy_entry.spell(entry) + _policy_entry.note(entry)
        print(f"{role + '.' if role else ''}{phase} = {spelled}")


def _cmd_demo(args: argparse.Namespace) -> int:
    import importlib.util

    from .demo import run_demo

    missing = [m for m in ("torch", "megatron") if importlib.util.find_spec(m) is None]
    if missing:
        raise MTPHooksError(
            f"the demo builds real megatron-core models, and {' and '.join(missing)} "
            "cannot be imported here. Install them with the megatron extra: pip install "
            "'.[megatron]' from a checkout, or run scripts/nox -s demo, which builds its own "
            "environment"
        )

    if args.policy is None:
        return run_demo(models=args.models)
    return run_demo(policy=args.policy, models=args.models)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mtp-hooks", description="Decide per forward call whether Megatron runs MTP."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plugins", help="list registered and blocked plugins")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_plugins)
    p = sub.add_parser(
        "options",
        help="list the policy options in force: how each is written, its TOML keys, its "
        "plugin hook, and the distribution that contributes it",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_options)
    p = sub.add_parser(
        "explain",
        help="explain the decision for a phase (and role)",
        description="Say what decides MTP for a phase, from the policy sources of this "
        "environment (MTP_HOOKS_POLICY, MTP_HOOKS_CONFIG) or --policy alone, and the installed "
        "plugins.",
    )
    p.add_argument("--phase", required=True, help="train, eval, rollout or a declared phase")
    p.add_argument("--role", default=None, help="a model role, e.g. teacher (default: none)")
    p.add_argument(
        "--policy",
        default=None,
        help="a compact policy string to explain instead of the environment's, e.g. "
        "'train=run,eval=skip'",
    )
    p.set_defaults(func=_cmd_explain)
    p = sub.add_parser(
        "check-config",
        help="validate a TOML policy file or a policy string; with neither, what "
        "MTP_HOOKS_POLICY and MTP_HOOKS_CONFIG set",
    )
    p.add_argument("file", nargs="?", help="a TOML file with a [policy] table")
    p.add_argument("--policy", help="a compact policy string, e.g. 'train=run,eval=skip'")
    p.set_defaults(func=_cmd_check_config)
    p = sub.add_parser("demo", help="run MTP policies on tiny real megatron-core models (CPU)")
    p.add_argument(
        "--policy",
        default=None,
        help="the policy the demo runs (default: train=run+metrics,eval=skip,rollout=skip)",
    )
    p.add_argument(
        "--models",
        default="gpt,hybrid",
        help="comma-separated: gpt,hybrid,nemotron (a Nemotron-3 hybrid, on a GPU only)",
    )
    p.set_defaults(func=_cmd_demo)
    return parser


def _version() -> str:
    """The installed distribution's version (a checkout run without installing has none)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("mtp-hooks")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI and return its exit status."""
    args = _parser().parse_args(argv)
    try:
        return int(args.func(args))
    except MTPHooksError as exc:
        print(f"mtp-hooks: error: {exc}", file=sys.stderr)
        return 2

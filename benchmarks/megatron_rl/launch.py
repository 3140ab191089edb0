"""Runs Megatron-LM's ``train_rl.py``, unedited, with only what the benchmark needs around it.

Under ``torchrun --nproc-per-node 1``::

    python launch.py --megatron-lm DIR --arm H --record steps.jsonl -- <train_rl.py arguments>

What it does, and why each step is needed:

1. **Checks DIR against the pins** (:mod:`pin`, ``megatron_lm.json``) and refuses any other
   tree: Megatron-LM's files must be those of the pinned commit, byte for byte.
2. **Puts DIR first on** ``sys.path``, so its ``megatron`` package (core, training, rl) runs,
   and this folder, so megatron can import the agent.
3. **Adds the agent to megatron's allowlist** (``megatron.rl.agent.registry.AGENT_REGISTRY``):
   an environment config may only name listed agents, and the benchmark's task ships with no
   Megatron-LM release. One dict entry; no megatron function is replaced.
4. **Starts the step recorder** (:mod:`steps`): one torch forward pre-hook on the model.
5. **mtp-hooks, for every arm but M**: ``mtp_hooks.auto_attach(clip_mtp_apart=True)`` (what
   ``MTP_HOOKS_AUTO=1`` does at start-up, and the MTP weights tagged for megatron's separate
   gradient clip as the model is built: ``+detach`` needs it, and ``train_rl.py`` builds the
   optimizer before any code of ours could call ``clip_mtp_apart``) and the arm's policy.
   H and A add a plugin whose ``mtp_loss_mask`` keeps MTP's loss on the response (the tokens
   after the prompt's ``=``, up to the end token); A adds an
   :class:`~mtp_hooks.framework.AcceptanceController` that the recorder feeds with the engine's
   own counters of each step's rollouts, before that step's policy update.
6. **Runs** ``train_rl.py`` as ``__main__`` (``runpy``), the way ``python train_rl.py`` would.
7. **Exits at once if it raises** (:func:`run_or_exit`): the engine's coordinator is a
   process that is not a daemon, so after an exception Python's exit would wait for it, and
   on the H200 an arm that had failed held the GPU until its timeout, six minutes later.

Arms: ``M`` megatron's default (mtp-hooks not imported); ``S`` ``train=skip,eval=skip``; ``H``
``train=run+detach,eval=skip`` with the response mask (``--no-mask`` drops it); ``A`` as H but
``train=auto+detach`` under the controller; ``K`` as H but MTP trained toward the policy's own
next-token distribution (``+objective:kl``), where the data are the policy's samples, as in RL
they are. The log-prob passes are ``no_grad`` forwards, which
mtp-hooks calls ``eval``; the policy-loss forward is ``train``; rollouts are never touched.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import traceback
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import pin  # noqa: E402
import steps  # noqa: E402

AGENT = ("MTPCountAgent", "agent:CountAgent")
POLICIES = {
    "M": None,
    "S": "train=skip,eval=skip",
    "H": "train=run+detach,eval=skip",
    "A": "train=auto+detach,eval=skip",
    "K": "train=run+detach+objective:kl,eval=skip",
}
MASKED = ("H", "A", "K")  # the arms whose MTP loss the response mask keeps to the response


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-lm", required=True, help="the unpacked, pinned tree")
    parser.add_argument("--arm", required=True, choices=sorted(POLICIES))
    parser.add_argument("--record", required=True, help="the JSON-lines file of the steps")
    parser.add_argument(
        "--no-mask", action="store_true", help="H, A or K without the response mask"
    )
    parser.add_argument(
        "--target",
        type=float,
        default=None,
        help="arm A's accepted-length target (default: 0.95 x the first step's)",
    )
    split = argv.index("--") if "--" in argv else len(argv)
    return parser.parse_args(argv[:split]), argv[split + 1 :]


def response_mask(input_ids: Any, separator: int, end: int) -> Any:
    """1 where a label is a response token: from the first separator's position to the one
    before the next end token (the label at position t is token t + 1). One sequence per row:
    a policy may write the separator in its own response, so only the first one ends the
    prompt, and packed rows are refused at start (:func:`refuse_packing`), not read here."""
    import torch

    length = input_ids.shape[-1]
    where = torch.arange(length, device=input_ids.device)
    is_separator = input_ids == separator
    first = torch.where(
        is_separator.any(-1), is_separator.int().argmax(-1), torch.full_like(where[:1], length)
    )
    is_end = (input_ids == end) & (where[None] > first[:, None])
    stop = torch.where(is_end.any(-1), is_end.int().argmax(-1), torch.full_like(where[:1], length))
    return (where[None] >= first[:, None]) & (where[None] < stop[:, None])


def refuse_packing(train_rl_args: list[str]) -> None:
    """The response mask reads one sequence per row, so packed rows must never reach it."""
    if "--rl-use-sequence-packing" in train_rl_args:
        raise SystemExit(
            "launch.py: arms H and A mask MTP's loss to the response of one sequence per row, "
            "and --rl-use-sequence-packing puts several in a row; drop that option, or run "
            "the arm with --no-mask"
        )


def token_ids(tokenizer_dir: str) -> tuple[int, int]:
    """The separator's and the end token's ids in the run's tokenizer."""
    from task import EOS, SEPARATOR

    with open(os.path.join(tokenizer_dir, "tokenizer.json")) as f:
        vocab = json.load(f)["model"]["vocab"]
    return vocab[SEPARATOR], vocab[EOS]


def option(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def set_up_mtp_hooks(own: argparse.Namespace, train_rl_args: list[str]) -> dict[str, Any]:
    """Attaches mtp-hooks as the arm says; returns the recorder's callbacks."""
    import mtp_hooks
    from mtp_hooks.framework import AcceptanceController, acceptance_from_counts
    from mtp_hooks.plugins import hookimpl, register

    mtp_hooks.auto_attach(clip_mtp_apart=True)
    mtp_hooks.configure(POLICIES[own.arm])
    callbacks: dict[str, Any] = {
        "trained_mtp": lambda model: mtp_hooks.decide(model, "train").run,
    }
    if own.arm in MASKED and not own.no_mask:
        refuse_packing(train_rl_args)
        separator, end = token_ids(option(train_rl_args, "--tokenizer-model") or "")

        class ResponseOnly:
            @hookimpl
            def mtp_loss_mask(
                self, model: Any, phase: Any, loss_mask: Any, labels: Any, input_ids: Any
            ) -> Any:
                return None if input_ids is None else response_mask(input_ids, separator, end)

        register(ResponseOnly(), name="response-only")
    if own.arm == "A":
        controller: dict[str, Any] = {"it": None}

        def on_rollouts(spec: dict[str, Any]) -> None:
            if not spec["proposed"]:
                return
            if controller["it"] is None:
                first = spec["accepted_length"] or 0.0
                target = own.target if own.target is not None else 0.95 * first
                controller["it"] = AcceptanceController(target=target, below=1.0, above=None)
                register(controller["it"], name="acceptance-controller")
            controller["it"].update(acceptance_from_counts(spec["proposed"], spec["accepted"]))

        callbacks["on_rollouts"] = on_rollouts
    return callbacks


def main(argv: list[str]) -> None:
    own, train_rl_args = parse(argv)
    tree = os.path.abspath(own.megatron_lm)
    pinned = pin.check(tree)  # 1
    sys.path.insert(0, tree)  # 2
    from megatron.rl.agent import registry

    registry.AGENT_REGISTRY.setdefault(*AGENT)  # 3
    callbacks = {} if own.arm == "M" else set_up_mtp_hooks(own, train_rl_args)  # 5
    recorder = steps.StepRecorder(own.record, **callbacks)  # 4
    recorder.write(
        {
            "arm": own.arm,
            "policy": POLICIES[own.arm],
            "mask": not own.no_mask,
            # run.sh isolated: other arms share the GPU, so this run's timers answer no goal
            "shared_gpu": os.environ.get("MEGATRON_RL_SHARED_GPU") == "1",
            "megatron_lm": pinned,
            "argv": train_rl_args,
        }
    )
    steps.install(recorder)
    sys.argv = [os.path.join(tree, "train_rl.py"), *train_rl_args]
    run_or_exit(lambda: runpy.run_path(sys.argv[0], run_name="__main__"))  # 6, 7


def run_or_exit(run: Callable[[], Any], exit: Callable[[int], Any] = os._exit) -> None:
    """``run()``; if it raises (a ``SystemExit`` of a failure code too), print the traceback and
    end the process with code 1 through ``exit``, skipping the interpreter's wait for
    non-daemon child processes. A clean ``SystemExit`` passes through."""
    try:
        run()
    except SystemExit as stop:
        if stop.code in (0, None):
            raise
        _fail(exit)
    except BaseException:
        _fail(exit)


def _fail(exit: Callable[[int], Any]) -> None:
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])

"""Runs Megatron-LM's ``train_rl.py``, unedited, with only what the benchmark needs around it.

Under ``torchrun --nproc-per-node 1``::

    python launch.py --megatron-lm DIR --arm H --record steps.jsonl -- <train_rl.py arguments>

What it does, and why each step is needed:

1. **Checks DIR against the pins** (:mod:`pin`, ``megatron_lm.json``) and refuses any other
   tree: Megatron-LM's files must be those of the pinned commit, byte for byte.
2. **Puts DIR first on** ``sys.path``, so its ``megatron`` package (core, training, rl) runs,
   and this folder, so megatron can import the agent. Refuses, before step 1, a setting that
   megatron is known to stop on later or to compute wrongly
   (:func:`refuse_drafting_past_the_rotary_table`, :func:`refuse_packing_that_truncates`,
   :func:`refuse_unpacked_micro_batches`).
3. **Adds the agent to megatron's allowlist** (``megatron.rl.agent.registry.AGENT_REGISTRY``):
   an environment config may only name listed agents, and the benchmark's task ships with no
   Megatron-LM release. One dict entry; no megatron function is replaced.
4. **Starts the step recorder** (:mod:`steps`): one torch forward pre-hook on the model.
5. **mtp-hooks, for every arm but M**: ``mtp_hooks.auto_attach(clip_mtp_apart=True)`` (what
   ``MTP_HOOKS_AUTO=1`` does at start-up, and the MTP weights tagged for megatron's separate
   gradient clip as the model is built: ``+detach`` needs it, and ``train_rl.py`` builds the
   optimizer before any code of ours could call ``clip_mtp_apart``) and the arm's policy.
   H and A add a plugin whose ``mtp_loss_mask`` keeps MTP's loss on the response (the tokens
   after the prompt's ``=``, up to the end token, in each trajectory of a row, packed rows
   too); A adds an
   :class:`~mtp_hooks_drafting.AcceptanceController` that the recorder feeds with the engine's
   own counters of each step's rollouts, before that step's policy update, and records what it
   found (whether the drafter died; with ``--step-cost``, the draft depth it advises, since
   megatron's engine fixes ``--num-speculative-tokens`` when it is built).
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
    parser.add_argument(
        "--stale-steps",
        type=int,
        default=0,
        help="arm A: run S's policy (MTP never trained) for this many steps first, so that "
        "the drafter goes stale before the controller takes over",
    )
    parser.add_argument(
        "--step-cost",
        type=float,
        default=None,
        help="arm A: what each drafted token adds to an engine step, relative to a step that "
        "drafts none; given, each step records the draft depth the controller advises",
    )
    split = argv.index("--") if "--" in argv else len(argv)
    return parser.parse_args(argv[:split]), argv[split + 1 :]


def response_mask(input_ids: Any, separator: int, end: int, starts: tuple[int, ...] = ()) -> Any:
    """1 where a label is a response token: in each trajectory of a row, from its first
    separator's position to the one before the next end token (the label at position t is
    token t + 1).

    A row holds one trajectory, or several back to back where megatron packs sequences
    (``--rl-use-sequence-packing``). A trajectory begins at the row's start and at each token
    in ``starts`` (the tokenizer's begin token and the task's command word); a separator that
    the policy writes inside its own response therefore stays in the response, since only the
    first one of a trajectory ends its prompt."""
    import torch

    rows, length = input_ids.shape
    where = torch.arange(length, device=input_ids.device).expand(rows, length)
    begins = torch.zeros_like(input_ids, dtype=torch.bool)
    for token in starts:
        begins |= input_ids == token
    # a begin token right after another (the begin token, then the command) starts nothing new
    begins[:, 1:] &= ~begins[:, :-1]
    begins[:, 0] = True
    row_offset = length * torch.arange(rows, device=where.device)[:, None]
    segment = begins.long().cumsum(-1) - 1 + row_offset  # one id per trajectory, over all rows
    flat, positions = segment.flatten(), where.flatten()
    never = torch.full((rows * length,), length, dtype=torch.long, device=where.device)

    def first(hit: Any) -> Any:
        # each position gets the first position of its own trajectory where ``hit`` holds
        candidates = torch.where(hit.flatten(), positions, length)
        return never.scatter_reduce(0, flat, candidates, "amin")[flat].view(rows, length)

    first_separator = first(input_ids == separator)
    stop = first((input_ids == end) & (where > first_separator))
    return (where >= first_separator) & (where < stop)


def refuse_drafting_past_the_rotary_table(train_rl_args: list[str]) -> None:
    """Refuses, before step 1, what stops a run in megatron-core's engine (0.19.0) later on.

    With rotary positions and ``--num-speculative-tokens K`` above 0, a request that grows to
    within ``K`` tokens of ``--inference-max-seq-length`` (one that never samples its end
    token, or whose end token came as an accepted draft, which ends no request) still feeds
    ``K`` draft positions past that length. The engine's rotary table has that many rows, and
    indexing it past its end is a device-side assert that ends the process. No length flag
    avoids it: a longer limit only moves it. Nemotron 3 uses no rotary positions at all."""
    k = int(option(train_rl_args, "--num-speculative-tokens") or 0)
    positions = option(train_rl_args, "--position-embedding-type")
    if k > 0 and positions in ("rope", "yarn", "mrope"):
        raise SystemExit(
            f"launch.py: --num-speculative-tokens {k} with --position-embedding-type {positions}"
            " stops the run with a device-side assert once a rollout drafts past "
            "--inference-max-seq-length (megatron-core's engine indexes its rotary table past "
            "its end there); use --position-embedding-type none, as Nemotron 3 does, or "
            "--num-speculative-tokens 0"
        )


def token_ids(tokenizer_dir: str) -> tuple[int, int, tuple[int, int]]:
    """The separator's and the end token's ids in the run's tokenizer, and the ids that begin
    a trajectory (the begin token and the command word)."""
    from task import BOS, COMMAND, EOS, SEPARATOR

    with open(os.path.join(tokenizer_dir, "tokenizer.json")) as f:
        vocab = json.load(f)["model"]["vocab"]
    return vocab[SEPARATOR], vocab[EOS], (vocab[BOS], vocab[COMMAND])


def refuse_packing_that_truncates(train_rl_args: list[str]) -> None:
    """Refuses, before step 1, sequence packing with rollouts shorter than a packed row.

    With ``--rl-use-sequence-packing``, ``--seq-length`` is the packed row's length, while a
    rollout stops at ``--inference-max-seq-length``. Megatron-LM's ``compute_group_stats``
    (``megatron/rl/rl_utils.py``, core_v0.19.0) asserts that a single-turn rollout either ends
    in the end token or is exactly ``--seq-length`` long ("Single-turn rollout under seq_length
    must end in eod"), so the first rollout the engine truncates at the shorter inference
    limit stops the run, with or without drafting; drafting only makes it come sooner, since
    an accepted end token ends no request. Seen on the H100 at steps 10 (k=0) and 17 (k=2)."""
    if "--rl-use-sequence-packing" not in train_rl_args:
        return
    row = int(option(train_rl_args, "--seq-length") or 0)
    limit = int(option(train_rl_args, "--inference-max-seq-length") or row)
    if limit < row:
        raise SystemExit(
            f"launch.py: --rl-use-sequence-packing with --inference-max-seq-length {limit} "
            f"below --seq-length {row} stops the run at the first rollout the engine truncates "
            "(megatron's compute_group_stats asserts that a rollout shorter than --seq-length "
            "ends in the end token); run without packing (PACK=0), or give both the same length"
        )


def refuse_unpacked_micro_batches(train_rl_args: list[str]) -> None:
    """Refuses, before step 1, more than one trajectory a forward without sequence packing.

    Unpacked, Megatron-LM (core_v0.19.0) still hands every forward of the log-prob passes
    (``get_logprobs`` in ``megatron/rl/rl_utils.py``) and of the update (``forward_step`` in
    ``train_rl.py``) a THD ``PackedSeqParams`` that describes one sequence of the row's length
    (``cu_seqlens = [0, seq_len]``), whatever ``--micro-batch-size`` is. Rows past the first are
    then outside the sequence the attention and Mamba layers are told of: the GPT stopped at
    the first log-prob pass (fused RoPE: "expected 3D tensor"). Whether the hybrid, which has
    no rotary positions, would stop or compute those rows wrongly was not run; neither is a
    recipe."""
    micro_batch = int(option(train_rl_args, "--micro-batch-size") or 1)
    if micro_batch > 1 and "--rl-use-sequence-packing" not in train_rl_args:
        raise SystemExit(
            f"launch.py: --micro-batch-size {micro_batch} without --rl-use-sequence-packing "
            "gives every forward one sequence's packing parameters for several rows (megatron's "
            "get_logprobs and train_rl.py's forward_step describe one row of the batch's "
            "length): run with MICRO_BATCH=1, or pack (PACK=1) with PACK_LENGTH equal to "
            "the rollout limit"
        )


def option(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def set_up_mtp_hooks(own: argparse.Namespace, train_rl_args: list[str]) -> dict[str, Any]:
    """Attaches mtp-hooks as the arm says; returns the recorder's callbacks."""
    import mtp_hooks
    from mtp_hooks.plugins import hookimpl, register

    mtp_hooks.auto_attach(clip_mtp_apart=True)
    mtp_hooks.configure(POLICIES[own.arm])
    callbacks: dict[str, Any] = {
        "trained_mtp": lambda model: mtp_hooks.decide(model, "train").run,
    }
    if own.arm in MASKED and not own.no_mask:
        separator, end, starts = token_ids(option(train_rl_args, "--tokenizer-model") or "")

        class ResponseOnly:
            @hookimpl
            def mtp_loss_mask(
                self, model: Any, phase: Any, loss_mask: Any, labels: Any, input_ids: Any
            ) -> Any:
                if input_ids is None:
                    return None
                return response_mask(input_ids, separator, end, starts)

        register(ResponseOnly(), name="response-only")
    if own.arm == "A":
        if own.stale_steps:
            mtp_hooks.configure(POLICIES["S"])
        callbacks["on_rollouts"] = controlled(own)
    return callbacks


def controlled(own: argparse.Namespace) -> Callable[[dict[str, Any]], dict[str, Any] | None]:
    """Arm A's callback of each step's rollouts: from the engine's counters of the step, the
    controller decides whether MTP trains, and says whether the drafter died and, with
    ``--step-cost``, how many tokens it would draft. The first step's accepted length sets the
    target; with ``--stale-steps N``, S's policy holds for N steps, and the controller, made at
    the first step all the same, takes over at step N + 1."""
    import warnings

    import mtp_hooks
    from mtp_hooks.plugins import register
    from mtp_hooks_drafting import AcceptanceController, acceptance_from_counts

    state: dict[str, Any] = {"it": None, "steps": 0}

    def on_rollouts(spec: dict[str, Any]) -> dict[str, Any] | None:
        state["steps"] += 1
        if own.stale_steps and state["steps"] == own.stale_steps + 1:
            mtp_hooks.configure(POLICIES["A"])
        if not spec["proposed"]:
            return None
        if state["it"] is None:
            first = spec["accepted_length"] or 0.0
            target = own.target if own.target is not None else 0.95 * first
            state["it"] = AcceptanceController(target=target, below=1.0, above=None)
            register(state["it"], name="acceptance-controller")
        controller = state["it"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # the engine drafts with the model that trains, so each update is a weight sync
            figures = acceptance_from_counts(spec["proposed"], spec["accepted"])
            controller.update(figures, synced=state["steps"] > 1)
        found: dict[str, Any] = {
            "trains_mtp": controller.weight is not None,
            "dead": controller.dead,
            "warnings": [str(w.message) for w in caught],
        }
        if own.step_cost is not None:
            advice = controller.advise(step_cost=own.step_cost)
            found["advised_k"] = advice.num_speculative_tokens
            found["speedups"] = list(advice.speedups)
        return found

    return on_rollouts


def main(argv: list[str]) -> None:
    own, train_rl_args = parse(argv)
    tree = os.path.abspath(own.megatron_lm)
    pinned = pin.check(tree)  # 1
    refuse_drafting_past_the_rotary_table(train_rl_args)
    refuse_packing_that_truncates(train_rl_args)
    refuse_unpacked_micro_batches(train_rl_args)
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

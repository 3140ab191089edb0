"""Rounds of the scenarios where a gate meets the garbage collector and other threads.

Run as a script, under ``-X faulthandler`` so a crash prints every thread's stack::

    python -X faulthandler tests/stress/rounds.py --rounds 200

Each round, on a GPTModel (every other round a HybridModel, where megatron-core has one):

* **lifetime**: attach, a skipped training forward and backward, drop model and handle, then
  ``gc.collect()``; the model must be freed;
* **copy**: a deep copy taken in the middle of a skipped forward, run, detached and dropped;
* **threads**: four threads forward one model at once while the interpreter switches threads
  as often as it can (``sys.setswitchinterval(1e-6)``); every forward is counted and no call
  record is left behind.

A failed check exits 1 naming the round; a crash is the interpreter's own exit. The last line
is ``stress: N rounds passed`` on success.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import sys
import threading
import weakref
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))

import mtp_hooks  # noqa: E402
from mtp_hooks.demo import tiny_models  # noqa: E402

from cpu_stand_ins import install_cpu_memory_buffer  # noqa: E402
from model_fixtures import SEQ, VOCAB, Wrapper, deepcopy_model, has_hybrid  # noqa: E402

SPEC = tiny_models.TinySpec(seq_length=SEQ, vocab_size=VOCAB)


def make_batch() -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(2, -1)
    mask = torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool)).logical_not()[None, None]
    return (ids, pos, mask.expand(2, 1, SEQ, SEQ)), torch.randint(0, VOCAB, (2, SEQ), generator=g)


def lifetime(build, args, labels, wrap: bool) -> None:
    model = build()
    outer = Wrapper(model) if wrap else model
    handle = mtp_hooks.attach(outer)
    mtp_hooks.configure("train=skip")
    outer(*args, labels=labels).sum().backward()
    ref = weakref.ref(model)
    del model, outer, handle
    gc.collect()
    check(ref() is None, "a dropped model and handle were not freed")


def copy_mid_forward(build, args, labels) -> None:
    model = build()
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip,eval=run")
    copies: list[torch.nn.Module] = []
    hook = model.decoder.register_forward_pre_hook(
        lambda m, a: copies.append(deepcopy_model(model)) if not copies else None
    )
    model(*args, labels=labels)
    hook.remove()
    (twin,) = copies
    twin.eval()
    with torch.no_grad():
        twin(*args, labels=labels)
    check(twin.mtp_process is True and twin.config.mtp_num_layers == 1, "copy kept a skip")
    mtp_hooks.remove(twin)


def threads(model, handle, args, labels, forwards: int = 5) -> None:
    before = handle.stats().get("eval", {}).get("run", 0)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            with torch.no_grad():
                for _ in range(forwards):
                    model(*args, labels=labels)
        except BaseException as exc:  # reported below
            errors.append(exc)

    workers = [threading.Thread(target=work) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
    check(not errors, f"a thread's forward raised {errors[:1]!r}")
    check(handle.gates[0].records == [], "a call record was left behind")
    runs = handle.stats()["eval"]["run"] - before
    check(runs == 4 * forwards, f"{runs} of {4 * forwards} forwards counted")


def serialize_blocks(model) -> None:
    """megatron's layers keep per-call state on the module, so its decoder and MTP block each
    run one thread at a time; the gate's hooks still run concurrently."""
    for block in (model.decoder, model.mtp):
        busy = threading.Lock()
        block.register_forward_pre_hook(lambda m, a, busy=busy: busy.acquire() and None)
        block.register_forward_hook(lambda m, a, o, busy=busy: busy.release(), always_call=True)


class Failed(Exception):
    pass


def check(condition: bool, what: str) -> None:
    if not condition:
        raise Failed(what)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    options = parser.parse_args()
    # the port the test hands over (MASTER_PORT), else one the OS gives
    port = None if "MASTER_PORT" in os.environ else tiny_models.free_port()
    tiny_models.init_single_process(port)
    install_cpu_memory_buffer()
    builders = [tiny_models.build_gpt] + ([tiny_models.build_hybrid] if has_hybrid() else [])
    args, labels = make_batch()
    shared = []
    for builder in builders:
        model = builder(SPEC)
        serialize_blocks(model)
        shared.append(model)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows
    try:
        for round_ in range(options.rounds):
            builder, model = builders[round_ % len(builders)], shared[round_ % len(builders)]
            build = functools.partial(builder, SPEC)
            try:
                mtp_hooks.testing.reset()
                tiny_models.reset_mtp_loss_tracker()
                lifetime(build, args, labels, wrap=round_ // len(builders) % 2 == 1)
                copy_mid_forward(build, args, labels)
                mtp_hooks.testing.reset()
                handle = mtp_hooks.attach(model)
                mtp_hooks.configure("eval=run")
                model.eval()
                threads(model, handle, args, labels)
                handle.remove()
                model.train()
            except Failed as failure:
                print(f"stress: round {round_} ({builder.__name__}): {failure}")
                return 1
            gc.collect()
    finally:
        sys.setswitchinterval(switch)
    print(f"stress: {options.rounds} rounds passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

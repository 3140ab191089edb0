"""An attached model under ``torch.compile`` with inductor, on one GPU: the record for the docs.

Run: ``python benchmarks/gpu_compile.py [--backend inductor] [--device cuda] [--out DIR]
[--forms forward,module]``. For a tiny real ``GPTModel`` with one MTP layer (megatron's local
specs, bf16 on CUDA), for each form of compiling it (``forward``:
``model.forward = torch.compile(model.forward)``, which leaves the module's hooks to torch's
eager call; ``module``: ``torch.compile(model)``, which traces them) and for each phase (a
training step, an evaluation with labels, a rollout's log-prob pass) under ``run`` and under
``skip``, it compiles two copies of the same weights the same way, one attached and one never
attached (for a skip: the trunk built without MTP), and reports:

* whether MTP ran (a forward hook on ``model.mtp``) and the handle's counts;
* whether the attached model's outputs (the loss or logits, and for a training step every
  trunk gradient) are bit for bit those of the compiled copy without hooks;
* the graph breaks dynamo counted for each, by reason, and the graphs and operations it
  captured: for the forward form, exactly the copy's; for the module form, the hooks' two
  breaks beyond them.

It prints a JSON line and a markdown table; ``--device cpu --backend eager`` is a smoke run.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PHASES = ("train", "eval", "rollout")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None, help="folder for the JSON record")
    parser.add_argument(
        "--cases",
        default="train:run,train:skip,eval:run,eval:skip,rollout:run,rollout:skip",
        help="phase:decision pairs, comma-separated (default: every phase, run and skip)",
    )
    parser.add_argument(
        "--forms",
        default="forward,module",
        help="how the model is compiled: forward (its forward), module (the module), or both",
    )
    args = parser.parse_args()
    forms = args.forms.split(",")
    if not set(forms) <= {"forward", "module"}:
        sys.exit(f"gpu_compile: --forms: {args.forms!r} names a form other than forward, module")
    os.environ["MTP_HOOKS_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    warnings.simplefilter("ignore")
    import torch
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    import mtp_hooks
    from mtp_hooks.demo import tiny_models

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_compile: no CUDA GPU is visible here; pass --device cpu --backend eager")
    tiny_models.init_single_process(port=tiny_models.free_port())
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32

    def build(mtp: bool):
        torch.manual_seed(0)
        spec = tiny_models.TinySpec(
            hidden_size=256, num_attention_heads=4, ffn_hidden_size=1024, vocab_size=1024,
            seq_length=128, mtp_num_layers=1 if mtp else None,
        )  # fmt: skip
        attention = "local" if args.device == "cuda" else "sdpa"
        return tiny_models.build_gpt(spec, attention=attention).to(args.device, dtype)

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 1024, (2, 128), generator=g).to(args.device)
    pos = torch.arange(128, device=args.device).unsqueeze(0).expand(2, -1)
    labels = torch.roll(ids, -1, dims=1)

    def step(model, compiled, phase):
        """The phase's forward (and a training step's backward): output and trunk grads."""
        model.zero_grad(set_to_none=True)
        model.train(phase == "train")
        with contextlib.ExitStack() as blocks:
            if phase != "train":
                blocks.enter_context(torch.no_grad())
            if phase == "rollout":
                blocks.enter_context(mtp_hooks.phase("rollout"))
            out = compiled(ids, pos, None, labels=None if phase == "rollout" else labels)
        grads = {}
        if phase == "train":
            out.float().sum().backward()
            grads = {
                n: p.grad.clone()
                for n, p in model.named_parameters()
                if p.grad is not None and not n.startswith("mtp.")
            }
        return out.detach(), grads

    def measured(model, phase, form):
        # the same tracker for both copies: the keys megatron adds at its first MTP loss are
        # guarded on, and a copy compiled after them would compile one graph fewer
        tiny_models.reset_mtp_loss_tracker(device=args.device)
        dynamo.reset()
        counters.clear()
        if form == "module":
            compiled = torch.compile(model, backend=args.backend)
        else:  # torch's call of the module looks its forward up on the instance first
            model.forward = torch.compile(model.forward, backend=args.backend)
            compiled = model
        try:
            step(model, compiled, phase)  # the compiling call
            out, grads = step(model, compiled, phase)
        finally:
            if form == "forward":
                del model.forward
        reasons = collections.Counter()
        for reason, n in counters["graph_break"].items():
            reasons[reason.splitlines()[0]] += n
        captured = (counters["stats"]["unique_graphs"], counters["stats"]["calls_captured"])
        return out, grads, reasons, captured

    cases = []
    for case in args.cases.split(","):
        phase, decision = case.split(":")
        if phase not in PHASES or decision not in ("run", "skip"):
            sys.exit(f"gpu_compile: --cases: {case!r} is not PHASE:run or PHASE:skip")
        cases.extend((form, phase, decision) for form in forms)
    # One eager training step first, so that what megatron sets up at its process's first MTP
    # step is in place before any copy is compiled (else the first copy compiles once more).
    tiny_models.reset_mtp_loss_tracker(device=args.device)
    warm = build(mtp=True)
    step(warm, warm, "train")
    del warm
    rows = []
    for form, phase, decision in cases:
        model = build(mtp=True)
        reference = build(mtp=decision == "run")  # for a skip: the trunk, same weights
        trunk = {k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")}
        reference.load_state_dict(trunk, strict=decision == "skip")
        ref_out, ref_grads, ref_reasons, ref_captured = measured(reference, phase, form)
        ran = tiny_models.MTPForwards(model)
        handle = mtp_hooks.attach(model)
        mtp_hooks.configure(f"{phase}={decision}")
        out, grads, reasons, captured = measured(model, phase, form)
        extra = reasons - ref_reasons
        rows.append(
            {
                "form": form,
                "phase": phase,
                "decision": decision,
                "mtp_forwards": ran.n,
                "stats": handle.stats(),
                "output_bitwise": bool(torch.equal(out, ref_out)),
                "trunk_grads_bitwise": all(torch.equal(grads[n], ref_grads[n]) for n in grads)
                and grads.keys() == ref_grads.keys(),
                "breaks_reference": sum(ref_reasons.values()),
                "breaks_attached_beyond_reference": dict(extra),
                "breaks_attached_fewer_than_reference": dict(ref_reasons - reasons),
                "graphs_and_operations": {"reference": ref_captured, "attached": captured},
                "gates_restored": model.mtp_process is True and not handle.gates[0].records,
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # kept if a later case dies
        handle.remove()
        mtp_hooks.configure(None)
    record = {
        "benchmark": "gpu_compile",
        "backend": args.backend,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "rows": rows,
    }
    print(json.dumps(record))
    print(f"\n{args.backend} on {record['device']}, torch {torch.__version__}\n")
    print("| compiled | phase | decision | MTP forwards | output bit for bit "
          "| trunk grads bit for bit | breaks beyond the copy without hooks "
          "| graphs, operations (copy; attached) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        extra = ", ".join(f"{k} x{v}" for k, v in r["breaks_attached_beyond_reference"].items())
        captured = r["graphs_and_operations"]
        grads = r["trunk_grads_bitwise"] if r["phase"] == "train" else "-"
        print(
            f"| {r['form']} | {r['phase']} | {r['decision']} | {r['mtp_forwards']} "
            f"| {r['output_bitwise']} | {grads} "
            f"| {extra or 'none'} | {captured['reference']}; {captured['attached']} |"
        )
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_compile.json"), "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()

"""Full-iteration CUDA graphs on a GPU, captured and replayed by megatron's own wrapper.

Skipped without CUDA. A GPTModel with ``cuda_graph_impl="full_iteration"`` trains through
``FullCudaGraphWrapper(get_forward_backward_func(), cuda_graph_warmup_steps=1)``, as
Megatron-LM's ``train()`` runs it: iteration 0 is eager, iteration 1 is captured, later ones
are replays that run no Python. The policy goes from ``train=run`` to ``train=skip`` before
iteration 3; mtp-hooks drops the captured graph, so iteration 3 is eager again, 4 is captured
and 5 replayed. Then three forward-only iterations (megatron's ``evaluate()``) run under
``eval=skip``. Each iteration's gradients and losses are compared with the same schedule run
eagerly, without graphs.
"""

from __future__ import annotations

import pytest
import torch

import mtp_hooks
from mtp_hooks.demo import tiny_models

pytestmark = [
    pytest.mark.usefixtures("cuda_mtp_tracker"),
]

STEPS, SWITCH, VALIDATION, MICROBATCHES, SEQ, MBS, VOCAB = 6, 3, 3, 2, 64, 2, 1024


def run(graphs: bool) -> dict:
    """Train STEPS iterations and validate VALIDATION; return what each iteration left."""
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper
    from megatron.core.pipeline_parallel import get_forward_backward_func

    object.__new__(FullCudaGraphWrapper).reset_cuda_graph()  # no graph of an earlier test
    spec = tiny_models.TinySpec(
        hidden_size=128, num_layers=2, num_attention_heads=4, vocab_size=VOCAB, seq_length=SEQ
    )
    torch.manual_seed(0)
    impl = "full_iteration" if graphs else "none"
    model = tiny_models.build_gpt(spec, attention="local", cuda_graph_impl=impl).cuda()
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("train=run,eval=skip")
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(
        0, VOCAB, (STEPS + VALIDATION, MICROBATCHES, MBS, SEQ), device="cuda", generator=g
    )
    pos = torch.arange(SEQ, device="cuda").unsqueeze(0).expand(MBS, -1)

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)["tokens"]
        output = model(tokens, pos, None, labels=torch.roll(tokens, -1, dims=1))

        def loss_func(output_tensor):
            loss = output_tensor.float().mean()
            return loss, {"lm loss": loss.detach()}

        return output, loss_func

    fwd_bwd = get_forward_backward_func()
    if graphs:
        fwd_bwd = FullCudaGraphWrapper(fwd_bwd, cuda_graph_warmup_steps=1)
    seen: dict = {"grads": [], "losses": [], "stats": [], "captured": []}
    for it in range(STEPS + VALIDATION):
        training = it < STEPS
        if it == SWITCH:
            mtp_hooks.configure("train=skip,eval=skip")
            seen["captured_after_switch"] = FullCudaGraphWrapper.cuda_graph["training"]
        if it == STEPS:
            model.eval()
        for p in model.parameters():
            if p.grad is not None:
                p.grad.zero_()  # in place: a replay accumulates into the captured tensors
        with torch.set_grad_enabled(training):
            out = fwd_bwd(
                forward_step_func=forward_step,
                data_iterator=iter([{"tokens": t} for t in ids[it]]),
                model=[model],
                num_microbatches=MICROBATCHES,
                seq_length=SEQ,
                micro_batch_size=MBS,
                forward_only=not training,
            )
        torch.cuda.synchronize()
        seen["losses"].append(torch.stack([o["lm loss"] for o in out]).clone())
        seen["grads"].append(
            {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        )
        seen["stats"].append(handle.stats())
        seen["captured"].append(
            {s: g is not None for s, g in FullCudaGraphWrapper.cuda_graph.items()}
        )
    handle.remove()
    object.__new__(FullCudaGraphWrapper).reset_cuda_graph()
    return seen


def decided(stats: dict, phase: str, what: str) -> int:
    return stats.get(phase, {}).get(what, 0)


def test_full_iteration_graphs_follow_a_policy_change_through_a_new_capture():
    graphed, eager = run(graphs=True), run(graphs=False)
    # the gate decides in eager and captured iterations only: 0 and 1 run, 3 and 4 skip
    runs = [decided(s, "train", "run") for s in graphed["stats"]]
    skips = [decided(s, "train", "skip") for s in graphed["stats"]]
    print("train runs per iteration", runs, "skips", skips)
    assert runs[:STEPS] == [2, 4, 4, 4, 4, 4] and skips[:STEPS] == [0, 0, 0, 2, 4, 4]
    assert graphed["captured_after_switch"] is None  # dropped by the policy change
    assert [c["training"] for c in graphed["captured"][:STEPS]] == [False, True, True] * 2
    # validation: eager, captured, replayed, all skipping MTP
    assert [decided(s, "eval", "skip") for s in graphed["stats"][STEPS:]] == [2, 4, 4]
    assert graphed["captured"][-1]["validation"]
    for it in range(STEPS + VALIDATION):
        diff = (graphed["losses"][it] - eager["losses"][it]).abs().max().item()
        print(f"iteration {it}: lm loss {graphed['losses'][it].tolist()} max diff {diff:.3g}")
        torch.testing.assert_close(graphed["losses"][it], eager["losses"][it], rtol=1e-5, atol=0)
    for it in range(STEPS):
        g, e = graphed["grads"][it], eager["grads"][it]
        mtp = [n for n in g if n.startswith("mtp.")]
        moved = any(g[n] is not None and g[n].abs().sum() > 0 for n in mtp)
        assert moved == (it < SWITCH), f"iteration {it}: MTP gradients moved={moved}"
        for name in g:
            if e[name] is None or not e[name].abs().sum():
                assert g[name] is None or not g[name].abs().sum(), (it, name)
            else:
                torch.testing.assert_close(g[name], e[name], rtol=1e-4, atol=1e-6)

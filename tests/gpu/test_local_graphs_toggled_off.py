"""Local CUDA graphs that Megatron-LM's RL loop turns off for its training passes, on a GPU.

``train_rl.py --cuda-graph-impl local`` builds its model with a real ``CudaGraphManager`` on
every transformer layer and block (CUDA only: a manager opens a CUDA stream when it is built),
and rolls out in those graphs. Before its log-prob and training passes it calls megatron's
``toggle_cuda_graphs(model, "none")``, which deletes every manager, and puts ``"local"`` back on
the config. While the managers exist, ``+detach`` is refused at attach, before any forward;
once they are gone, the passes are eager and every policy holds: a detached training step
leaves the trunk's gradients bit for bit those of a skipped one, and an ``eval=skip`` pass
runs no MTP. The CPU tests check the same with a stand-in for the manager.
"""

from __future__ import annotations

import pytest
import torch

import mtp_hooks
from mtp_hooks.demo import tiny_models

from model_fixtures import has_detach_field

pytestmark = [
    pytest.mark.skipif(not has_detach_field(), reason="+detach needs mtp_detach_heads (0.19)"),
    pytest.mark.usefixtures("cuda_mtp_tracker"),
]

SEQ, MBS, VOCAB = 64, 2, 1024


def build() -> torch.nn.Module:
    """A GPT with MTP built as ``--cuda-graph-impl local`` builds it: real graph managers."""
    spec = tiny_models.TinySpec(
        hidden_size=128, num_layers=2, num_attention_heads=4, vocab_size=VOCAB, seq_length=SEQ
    )
    torch.manual_seed(0)
    model = tiny_models.build_gpt(spec, attention="local", cuda_graph_impl="local").cuda()
    mtp_hooks.megatron.clip_mtp_apart(model)
    return model


def toggle_off(model: torch.nn.Module) -> torch.nn.Module:
    """What ``train_rl.py`` does before its log-prob and training passes."""
    from megatron.core.transformer.utils import toggle_cuda_graphs

    toggle_cuda_graphs(model, "none")
    model.config.cuda_graph_impl = "local"
    return model


def trained(model: torch.nn.Module, policy: str) -> dict:
    """One training forward and backward under ``policy``, then one ``no_grad`` evaluation
    pass; the gradients, and how often the MTP block ran in each."""
    runs = []
    probe = model.mtp.register_forward_hook(lambda *_: runs.append(torch.is_grad_enabled()))
    mtp_hooks.configure(policy)
    handle = mtp_hooks.attach(model)
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, VOCAB, (MBS, SEQ), device="cuda", generator=g)
    pos = torch.arange(SEQ, device="cuda").unsqueeze(0).expand(MBS, -1)
    model.train()
    model(ids, pos, None, labels=torch.roll(ids, -1, dims=1)).float().mean().backward()
    model.eval()
    with torch.no_grad():
        model(ids, pos, None, labels=torch.roll(ids, -1, dims=1))
    torch.cuda.synchronize()
    handle.remove()
    probe.remove()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return {
        "trunk": {n: g for n, g in grads.items() if not n.startswith("mtp.")},
        "mtp": {n: g for n, g in grads.items() if n.startswith("mtp.")},
        "runs": runs,
    }


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def test_detach_is_refused_while_the_graph_managers_exist():
    model = build()
    assert any(hasattr(m, "cudagraph_manager") for m in model.modules())
    mtp_hooks.configure("train=run+detach,eval=skip")
    with pytest.raises(mtp_hooks.UnsupportedModelError, match="CUDA graphs"):
        mtp_hooks.attach(model)
    assert not model._forward_pre_hooks


def test_with_the_graphs_toggled_off_a_detached_step_leaves_the_trunk_as_a_skip_does():
    # both models stay alive: megatron caches graph attributes by id(model)
    skip_model, detach_model = toggle_off(build()), toggle_off(build())
    assert not any(hasattr(m, "cudagraph_manager") for m in detach_model.modules())
    skipped = trained(skip_model, "train=skip,eval=skip")
    detached = trained(detach_model, "train=run+detach,eval=skip")
    assert skipped["runs"] == [] and detached["runs"] == [True]  # evaluation ran no MTP
    assert skipped["trunk"].keys() == detached["trunk"].keys()
    assert all(same(skipped["trunk"][n], detached["trunk"][n]) for n in skipped["trunk"])
    assert any(g is not None for g in skipped["trunk"].values())
    assert all(g is None for g in skipped["mtp"].values())  # a skip trains no MTP weight
    assert all(g is not None for g in detached["mtp"].values())  # a detached step trains each
    assert any(bool(g.abs().sum() > 0) for g in detached["mtp"].values())

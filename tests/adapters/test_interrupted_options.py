"""Every option that installs a hook, interrupted at every point of a forward, then a forward or
``handle.remove()``: the models' hook dictionaries end as they were before attach, and the
recorded figures count only the forwards that completed.

The points: the embedding, the trunk, inside the MTP block (its first layer), each depth's
output projection, the policy's projection, and the loss. Interrupted by an exception (which
torch's ``always_call`` hooks see) and by Ctrl-C (which they do not).
"""

from __future__ import annotations

import pytest
import torch

import mtp_hooks
from mtp_hooks.demo import tiny_models

from model_fixtures import SEQ, VOCAB, guards_empty_masks, has_detach_field

DEPTHS = 2
OPTIONS = {
    "metrics": "run+metrics",
    "weight": "run:0.5",
    "mask": "run+mask:labels",
    "detach": "run+detach",
    "objective": "run+detach+objective:kl",
    "everything": "run:0.5+detach+objective:kl+metrics+mask:labels",
}
POINTS = ["embedding", "trunk", "mtp", "depth-1", "depth-2", "policy", "loss"]


@pytest.fixture
def deep(build, mtp_tracker):
    tiny_models.reset_mtp_loss_tracker(num_layers=DEPTHS)  # training forwards log each depth

    def make(seed: int = 0):
        model = build(
            seed,
            spec=tiny_models.TinySpec(seq_length=SEQ, vocab_size=VOCAB, mtp_num_layers=DEPTHS),
        )
        if has_detach_field():
            mtp_hooks.megatron.clip_mtp_apart(model)
        return model

    return make


def hooks(model: torch.nn.Module) -> dict[str, tuple]:
    """Every module's forward hooks and pre-hooks, by name: what attach may add."""
    return {
        name: (tuple(m._forward_pre_hooks), tuple(m._forward_hooks))
        for name, m in model.named_modules()
    }


def stopper(model, point: str, exc: type[BaseException]):
    """A hook that raises ``exc`` at ``point`` of ``model``'s next forward; returns its handle."""

    def stop(*args):
        raise exc(f"stopped at {point}")

    if point in ("embedding", "trunk", "mtp"):
        target = {"embedding": model.embedding, "trunk": model.decoder, "mtp": model.mtp.layers[0]}
        return target[point].register_forward_pre_hook(stop)
    if point == "loss":
        return _wrap_loss(model, stop)
    calls = {"n": 0}
    index = {"depth-1": 0, "depth-2": 1, "policy": DEPTHS}[point]

    def counted(*args):
        calls["n"] += 1
        if calls["n"] == index + 1:
            stop()

    return model.output_layer.register_forward_pre_hook(counted)


class _wrap_loss:
    """``compute_language_model_loss`` raising on this instance (removed by ``remove()``)."""

    def __init__(self, model, stop) -> None:
        self.model = model
        model.compute_language_model_loss = lambda *a, **k: stop()

    def remove(self) -> None:
        del self.model.compute_language_model_loss


def policy_for(option: str) -> str:
    if "detach" in OPTIONS[option] and not has_detach_field():
        pytest.skip("+detach needs mtp_detach_heads (0.19 on)")
    if "mask" in OPTIONS[option] and not guards_empty_masks():
        pytest.skip("this megatron-core takes no MTP loss mask (0.18 on): refused at configure")
    return f"train={OPTIONS[option]},eval={OPTIONS[option].replace('+objective:kl', '')}"


def one_forward(model, batch, phase: str) -> None:
    """A training forward and backward, or an eval forward, with a prompt of -100 labels."""
    labels = batch.labels.clone()
    labels[:, :3] = -100
    if phase == "train":
        model.train()
        model(*batch.args(), labels=labels).sum().backward()
    else:
        model.eval()
        with torch.no_grad():
            model(*batch.args(), labels=labels)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError], ids=["ctrl-c", "error"])
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_after_an_interrupt_remove_leaves_every_hook_as_before_attach(
    deep, batch, option, point, exc
):
    model = deep()
    before = hooks(model)
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure(policy_for(option))
    stop = stopper(model, point, exc)
    with pytest.raises(exc):
        one_forward(model, batch, "train")
    stop.remove()
    handle.remove()
    assert hooks(model) == before


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError], ids=["ctrl-c", "error"])
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_after_an_interrupt_the_next_forward_counts_alone_and_leaves_no_hook_behind(
    deep, batch, option, point, exc
):
    model, alone = deep(seed=3), deep(seed=3)
    before = hooks(model)
    handle, reference = mtp_hooks.attach(model), mtp_hooks.attach(alone)
    mtp_hooks.configure(policy_for(option))
    stop = stopper(model, point, exc)
    with pytest.raises(exc):
        one_forward(model, batch, "eval")
    stop.remove()
    one_forward(model, batch, "eval")
    one_forward(alone, batch, "eval")
    gate_hooks = {"": (tuple(model._forward_pre_hooks), tuple(model._forward_hooks))}
    assert hooks(model) == {**before, **gate_hooks}  # only the gate's own two hooks remain
    if "metrics" in OPTIONS[option]:
        got, want = handle.metrics()["eval"], reference.metrics()["eval"]
        assert got.forwards == 1 and got == want
    else:
        assert handle.metrics() == {}

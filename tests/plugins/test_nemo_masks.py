"""The NeMo-RL plugin's MTP loss mask: NeMo-RL's token x sample mask, and the positive-only
gate, trained on real models through an ``mtp_hooks.mtp_loss_mask`` block."""

from __future__ import annotations

import pytest
import torch

import mtp_hooks
import mtp_hooks_nemo

from model_fixtures import BATCH, SEQ, guards_empty_masks


def rl_batch(n: int = 4) -> dict:
    """A NeMo-RL training batch: response tokens, the last sample masked out, advantages from
    1 down to -1."""
    token_mask = torch.zeros(n, SEQ)
    token_mask[:, SEQ // 2 :] = 1
    sample_mask = torch.ones(n)
    sample_mask[-1] = 0
    advantages = torch.linspace(1, -1, n).unsqueeze(-1).expand(n, SEQ).contiguous()
    return {"token_mask": token_mask, "sample_mask": sample_mask, "advantages": advantages}


def test_the_mask_is_nemo_rls_token_mask_times_sample_mask():
    batch = rl_batch()
    expected = batch["token_mask"] * batch["sample_mask"].unsqueeze(-1)
    assert torch.equal(mtp_hooks_nemo.mtp_loss_mask(batch), expected)


def test_positive_only_keeps_the_tokens_with_a_positive_advantage_per_token_or_per_sample():
    batch = rl_batch()
    gated = mtp_hooks_nemo.mtp_loss_mask(batch, positive_only=True)
    kept = (batch["advantages"] > 0).float() * batch["token_mask"]
    kept = kept * batch["sample_mask"].unsqueeze(-1)
    assert torch.equal(gated, kept) and 0 < gated.sum() < mtp_hooks_nemo.mtp_loss_mask(batch).sum()
    per_sample = dict(batch, advantages=batch["advantages"][:, 0])
    assert torch.equal(mtp_hooks_nemo.mtp_loss_mask(per_sample, positive_only=True), gated)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"token_mask": None}, "'token_mask'"),
        ({"sample_mask": torch.ones(5)}, "'sample_mask' has shape"),
        ({"token_mask": torch.ones(SEQ)}, "'token_mask' must be"),
        ({"advantages": torch.ones(4, SEQ + 1)}, "'advantages' has shape"),
        ({"advantages": None}, "'advantages'"),
        ({"advantages": torch.ones(4, SEQ, 1)}, r"'advantages' has shape \(4, 16, 1\)"),
        ({"advantages": torch.tensor(1.0)}, r"'advantages' has shape \(\)"),
        ({"advantages": torch.ones(4, 2)}, "'advantages' has shape"),
        ({"advantages": torch.ones(5)}, "'advantages' has shape"),
        ({"sample_mask": torch.tensor(1.0)}, "'sample_mask' has shape"),
    ],
)
def test_a_missing_or_misshapen_key_is_refused_naming_it(change, named):
    assert SEQ == 16  # the patterns name the shapes
    with pytest.raises(mtp_hooks.PolicyError, match=named):
        mtp_hooks_nemo.mtp_loss_mask(dict(rl_batch(), **change), positive_only=True)


@pytest.mark.skipif(not guards_empty_masks(), reason="masks are refused on megatron 0.16")
def test_in_a_block_it_trains_mtp_as_nemo_rl_passing_that_mask_as_loss_mask(build, batch):
    nemo = rl_batch(BATCH + 1)  # the last sample (masked out) dropped: one gated out per sample
    nemo = {key: value[:BATCH] for key, value in nemo.items()}
    mask = mtp_hooks_nemo.mtp_loss_mask(nemo, positive_only=True)
    assert 0 < mask.sum() < mtp_hooks_nemo.mtp_loss_mask(nemo).sum()
    grads = []
    for blocked in (True, False):
        model = build(seed=9)
        model.train()
        kwargs = {"labels": batch.labels}
        if blocked:
            mtp_hooks.attach(model)
            with mtp_hooks.mtp_loss_mask(mask):
                model(*batch.args(), **kwargs).sum().backward()
        else:
            model(*batch.args(), loss_mask=mask, **kwargs).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_advantages_of_shape_batch_seq_1_are_refused_even_where_batch_equals_seq():
    """[B, S, 1] with B == S once broadcast silently to a [B, S, S] mask."""
    square = {
        "token_mask": torch.ones(SEQ, SEQ),
        "sample_mask": torch.ones(SEQ),
        "advantages": torch.ones(SEQ, SEQ, 1),
    }
    with pytest.raises(mtp_hooks.PolicyError, match="'advantages' has shape"):
        mtp_hooks_nemo.mtp_loss_mask(square, positive_only=True)
    square["advantages"] = torch.ones(SEQ, 1)
    assert mtp_hooks_nemo.mtp_loss_mask(square, positive_only=True).shape == (SEQ, SEQ)

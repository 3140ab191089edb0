"""Where megatron-core's MTP loss divides by an unguarded count of masked-in positions (0.16),
every MTP loss mask is refused before the forward, and ``+mask`` at attach."""

from __future__ import annotations

import pytest
import torch

import mtp_hooks

pytestmark = pytest.mark.skipif(
    hasattr(
        pytest.importorskip("megatron.core.transformer.multi_token_prediction"),
        "process_mtp_loss",
    ),
    reason="this megatron-core guards an empty MTP loss mask",
)


def test_a_mask_block_is_refused_before_mtp_runs_naming_the_nan_it_would_cause(
    build, batch, count_mtp
):
    model = build()
    counter = count_mtp(model)
    mtp_hooks.attach(model)
    model.train()
    with mtp_hooks.mtp_loss_mask(torch.ones(batch.labels.shape)):
        needs = r"NaN. Upgrade megatron-core \(0.17 and later need Python 3.12\)"
        with pytest.raises(mtp_hooks.UnsupportedModelError, match=needs):
            model(*batch.args(), labels=batch.labels)
    assert counter.n == 0
    model(*batch.args(), labels=batch.labels)
    assert counter.n == 1


def test_mask_labels_in_the_policy_is_refused_at_attach(build):
    model = build()
    mtp_hooks.configure("train=run+mask:labels")
    with pytest.raises(mtp_hooks.UnsupportedModelError, match="masks it in train"):
        mtp_hooks.attach(model)
    assert not model._forward_pre_hooks

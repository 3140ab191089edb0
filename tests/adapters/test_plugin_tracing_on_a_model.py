"""The hooks a forward of a real model asks (the loss mask, the metrics) are called through
pluggy too: monitoring sees them with the plugin that answered."""

from __future__ import annotations

import pytest
import torch

import mtp_hooks

from model_fixtures import guards_empty_masks
from plugin_answers import answers


@pytest.mark.skipif(
    not guards_empty_masks(), reason="this megatron-core refuses per-call masks (0.18 on)"
)
def test_a_training_forward_shows_its_mask_call_to_pluggys_monitoring(build, batch, monitored):
    model = build(seed=2)
    mtp_hooks.attach(model)
    mask = torch.ones_like(batch.labels, dtype=torch.float32)
    answers("mtp_loss_mask", mask, name="masker")
    model.train()
    model(*batch.args(), labels=batch.labels)
    by_hook = {(hook, names): answer for hook, names, answer in monitored}
    assert by_hook[("mtp_loss_mask", ("masker",))][0] is mask


def test_an_evaluation_shows_its_metrics_call_to_pluggys_monitoring(build, batch, monitored):
    model = build(seed=2)
    mtp_hooks.attach(model)
    mtp_hooks.configure("eval=run+metrics")
    listener = answers("mtp_metrics", None, name="listener")
    model.eval()
    with torch.no_grad():
        model(*batch.args(), labels=batch.labels)
    assert [names for hook, names, _ in monitored if hook == "mtp_metrics"] == [("listener",)]
    assert len(listener.calls) == 1 and listener.calls[0][1] == "eval"

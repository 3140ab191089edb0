"""The hooks a forward of a real model asks (the loss mask, the metrics) are called through
pluggy too: monitoring sees them with the plugin that answered."""

from __future__ import annotations

import torch

import mtp_hooks

from plugin_answers import answers


def test_a_forward_shows_its_mask_and_metrics_calls_to_pluggys_monitoring(build, batch, monitored):
    model = build(seed=2)
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=run,eval=run+metrics")
    mask = torch.ones_like(batch.labels, dtype=torch.float32)
    answers("mtp_loss_mask", mask, name="masker")
    listener = answers("mtp_metrics", None, name="listener")
    model.train()
    model(*batch.args(), labels=batch.labels)
    model.eval()
    with torch.no_grad():
        model(*batch.args(), labels=batch.labels)
    by_hook = {(hook, names): answer for hook, names, answer in monitored}
    assert by_hook[("mtp_loss_mask", ("masker",))][0] is mask
    assert ("mtp_metrics", ("listener",)) in by_hook
    assert len(listener.calls) == 1 and listener.calls[0][1] == "eval"

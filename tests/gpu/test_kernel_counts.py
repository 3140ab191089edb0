"""On a GPU, with megatron's local layers: a skipped train step, log-prob forward and eval
forward launch exactly the CUDA kernels of the model built without MTP (the Transformer Engine
versions are in test_transformer_engine.py; the CPU version, counting ATen operations, is
tests/adapters/test_dispatched_ops.py). All three count through tests/dispatch_counts.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mtp_hooks
from mtp_hooks.demo import tiny_models

from dispatch_counts import dispatched, phase_steps

pytestmark = [
    pytest.mark.usefixtures("cuda_mtp_tracker"),
]

SEQ, VOCAB = 64, 256


def test_a_skip_launches_exactly_the_kernels_of_the_model_built_without_mtp():
    spec = tiny_models.TinySpec(seq_length=SEQ, vocab_size=VOCAB)
    torch.manual_seed(0)
    model = tiny_models.build_gpt(spec, attention="sdpa").cuda()
    torch.manual_seed(0)
    plain = tiny_models.build_gpt(
        dataclasses.replace(spec, mtp_num_layers=None), attention="sdpa"
    ).cuda()
    ids = torch.randint(0, VOCAB, (2, SEQ), device="cuda")
    args = (ids, torch.arange(SEQ, device="cuda").expand(2, -1), None)
    labels = torch.roll(ids, -1, 1)
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip,eval=skip,rollout=skip")
    built = phase_steps(plain, args, labels)
    for name, step in phase_steps(model, args, labels).items():
        skipped, without = dispatched(step, "cuda"), dispatched(built[name], "cuda")
        print(name, sum(skipped.values()), "kernels")
        assert sum(skipped.values()) > 20, name
        assert skipped == without, (name, skipped - without, without - skipped)

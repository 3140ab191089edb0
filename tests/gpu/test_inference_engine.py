"""megatron-core's inference engine, speculating with the MTP layers, is untouched by mtp-hooks.

Skipped without CUDA and FlashAttention (the engine's paged KV cache needs it). A GPTModel with
two MTP layers, trained for a few steps on a phrase language so that its drafts are partly
accepted, rolls out greedily in ``DynamicInferenceEngine`` drafting two tokens: first with
nothing attached, then attached under each policy, ``rollout=skip`` included. Every rollout
must give the same tokens, token for token, and the same per-position acceptance counts, and
the handle must count the engine's forwards as untouched inference.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch

import mtp_hooks

from engine_rollouts import assert_attaching_changes_no_rollout

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "rl_drafter"))


def _flash_attention() -> bool:
    """FlashAttention 2 or 3 (``flash_attn``, ``flash_attn_interface``) or 4
    (``flash_attn.cute``), whichever megatron's paged attention can call."""
    import importlib.util

    names = ("flash_attn", "flash_attn_interface", "flash_attn_3")
    return any(importlib.util.find_spec(name) is not None for name in names)


pytestmark = [
    pytest.mark.skipif(
        torch.cuda.is_available() and not _flash_attention(),
        reason="the inference engine needs FlashAttention >= 2.7.3, 3 or 4",
    ),
]

POLICIES = [
    "rollout=skip",
    "rollout=run",
    "train=run+detach,eval=run+metrics,rollout=skip",
    "train=skip,eval=skip,rollout=run:0.5",
]


@pytest.fixture(scope="module")
def trained():
    import gpu_rl_drafter as bench

    from mtp_hooks.demo import tiny_models

    args = bench.parse_args(
        [
            "--hidden",
            "256",
            "--layers",
            "2",
            "--heads",
            "4",
            "--vocab",
            "512",
            "--phrases",
            "64",
            "--seq",
            "128",
            "--batch",
            "8",
            "--prompts",
            "4",
            "--prompt-len",
            "16",
            "--gen",
            "32",
        ]
    )
    tiny_models.init_single_process(port=tiny_models.free_port())
    tiny_models.reset_mtp_loss_tracker(num_layers=bench.DEPTH, device="cuda")
    model = bench.build_model(args)
    mtp_hooks.megatron.clip_mtp_apart(model)  # one policy below detaches in training
    trainer = bench.Trainer(model, args.lr, args.clip)
    lang = bench.PhraseLanguage(args.vocab, args.phrases, 1)
    for step in range(150):
        ids = lang.sample(args.batch, args.seq, (1, step))
        bench.train_step(model, trainer, ids, "cuda")
    engine = bench.EngineRollouts(model, bench.DEPTH, args)
    prompts = bench.prompts_at(lang, args, 0)
    engine(prompts, args.gen)  # FlashAttention compiles per shape on first use
    return SimpleNamespace(model=model, engine=engine, prompts=prompts, gen=args.gen)


def test_the_engine_drafts_and_accepts_some_drafts(trained):
    plain = trained.engine(trained.prompts, trained.gen)
    assert plain.drafts[0] > 0
    assert 0 < plain.accepted[0] <= plain.drafts[0]


@pytest.mark.parametrize("policy", POLICIES)
def test_rollouts_are_token_for_token_those_of_the_model_with_nothing_attached(trained, policy):
    assert_attaching_changes_no_rollout(
        trained.model, policy, lambda: trained.engine(trained.prompts, trained.gen)
    )

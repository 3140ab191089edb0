"""Which tokens a ``HybridModel``'s MTP trains on, for the two ways veRL hands over its loss mask,
on a hand-built rollout whose answer is known.

A rollout of ``PROMPT`` prompt tokens and ``RESPONSE`` response tokens. MTP depth 1 at position
``t`` predicts token ``t + 2``; it should train exactly where that token is a response token.
The positions it trains on are read off the model: the MTP logits that receive a gradient.

* **veRL's draft for native HybridModel MTP (#7192)** passes ``labels=None`` and the response
  mask aligned with ``input_ids``; megatron derives the labels and rolls the mask with them.
  mtp-hooks-verl's worker default runs MTP in such a training forward (it passes a mask).
* **veRL 0.9.1** rolls its mask to the labels it passes (``need_roll=True``) and passes both.
  Were the labels dropped from that call (which would make a HybridModel return logits, as
  veRL 0.9.1 needs), megatron would roll the rolled mask again: MTP would train one token off.
  That is why mtp-hooks does not rewrite veRL 0.9.1's calls (docs/integrations.md, veRL).
"""

from __future__ import annotations

import pytest
import torch

import mtp_hooks
from mtp_hooks.demo import tiny_models
from mtp_hooks.megatron._capabilities import mtp_loss_derives_labels

from model_fixtures import has_hybrid

pytestmark = [
    pytest.mark.skipif(not has_hybrid(), reason="HybridModel needs megatron-core 0.18+"),
    pytest.mark.skipif(
        not mtp_loss_derives_labels(), reason="this megatron-core trains MTP only on given labels"
    ),
]
pytest.importorskip("verl")

PROMPT, RESPONSE = 3, 5
SEQ = PROMPT + RESPONSE


def response_mask() -> torch.Tensor:
    """1 at the response tokens of the rollout, aligned with ``input_ids``."""
    return (torch.arange(SEQ) >= PROMPT).float()[None]


def trained_positions(model, **call) -> list[int]:
    """The positions whose MTP logits get a gradient in a training forward of ``call``."""
    logits: list[torch.Tensor] = []

    def keep(module, args, output):
        output[0].retain_grad()
        logits.append(output[0])

    handle = model.output_layer.register_forward_hook(keep)
    try:
        model.train()
        ids = torch.randint(0, 128, (1, SEQ), generator=torch.Generator().manual_seed(5))
        out = model(ids, torch.arange(SEQ)[None], None, **call)
        (out * 0).sum().backward()  # only the MTP loss, attached to the hidden states, trains
    finally:
        handle.remove()
    (mtp_logits,) = [x for x in logits if x.grad is not None and x.grad.abs().sum() > 0]
    per_position = mtp_logits.grad.abs().sum(-1).squeeze(1)  # [s, b, vocab] -> [s]
    return [t for t in range(SEQ) if per_position[t] > 0]


@pytest.fixture
def hybrid(megatron_cpu, only):
    tiny_models.reset_mtp_loss_tracker()
    only("verl")  # unconfigured, in a process that imported verl: veRL's worker default
    torch.manual_seed(0)
    model = tiny_models.build_hybrid(
        tiny_models.TinySpec(seq_length=SEQ, vocab_size=128), attention="sdpa", pattern="*-/*-"
    )
    mtp_hooks.attach(model)
    return model


# depth 1 at position t predicts token t + 2: the response tokens are 3..7, so t = 1..5
RESPONSE_TARGETS = [t for t in range(SEQ - 2) if t + 2 >= PROMPT]


def test_the_native_hybrid_call_trains_mtp_exactly_on_the_response_tokens(hybrid):
    assert RESPONSE_TARGETS == [1, 2, 3, 4, 5]
    positions = trained_positions(hybrid, labels=None, loss_mask=response_mask())
    assert positions == RESPONSE_TARGETS


def test_veRL_0_9_1s_rolled_mask_without_its_labels_would_train_one_token_off(hybrid):
    rolled = torch.roll(response_mask(), -1, dims=1)
    rolled[:, -1] = 0  # what need_roll=True hands over: aligned to the labels
    positions = trained_positions(hybrid, labels=None, loss_mask=rolled)
    assert positions == [t - 1 for t in RESPONSE_TARGETS]  # each one token early: wrong


def test_in_a_veRL_worker_a_training_forward_without_mask_or_labels_trains_no_mtp(hybrid):
    # veRL 0.9.1 with enable_train=False passes neither; megatron would run MTP on every token
    ran = tiny_models.MTPForwards(hybrid)
    hybrid.train()
    ids = torch.randint(0, 128, (1, SEQ))
    hybrid(ids, torch.arange(SEQ)[None], None).sum().backward()
    assert ran.n == 0
    assert all(
        p.grad is None or not p.grad.any() for n, p in hybrid.named_parameters() if "mtp" in n
    )

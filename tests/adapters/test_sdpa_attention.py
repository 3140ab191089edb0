"""The demo models' SDPA core attention (``attention="sdpa"``) on packed (THD) sequences: each
sequence attends to its own earlier tokens only, and the mask is made where the queries are."""

from __future__ import annotations

import itertools

import pytest
import torch

from mtp_hooks.demo import tiny_models

from model_fixtures import SEQ, VOCAB

HEADS, HEAD_DIM = 4, 16


@pytest.fixture
def core_attention(megatron_cpu) -> torch.nn.Module:
    spec = tiny_models.TinySpec(seq_length=SEQ, vocab_size=VOCAB, num_attention_heads=HEADS)
    model = tiny_models.build_gpt(spec, attention="sdpa")
    return model.decoder.layers[0].self_attention.core_attention


def packed(cuts: list[int], device: str | torch.device):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor(cuts, dtype=torch.int32, device=device)
    longest = max(b - a for a, b in itertools.pairwise(cuts))
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def test_packed_sequences_attend_as_each_sequence_does_alone(core_attention):
    cuts = [0, 5, 12, SEQ]
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(SEQ, HEADS, HEAD_DIM, generator=g) for _ in range(3))  # [t, n, d]
    out = core_attention(q, k, v, None, packed_seq_params=packed(cuts, "cpu"))
    for start, end in itertools.pairwise(cuts):  # one sequence, unpacked: [s, b=1, n, d]
        alone = core_attention(*(t[start:end].unsqueeze(1) for t in (q, k, v)), None)
        torch.testing.assert_close(out[start:end], alone.squeeze(1), rtol=0, atol=1e-6)


class Devices(torch.overrides.TorchFunctionMode):
    """The devices of the tensors that torch functions return while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, tuple) else (out,):
            if isinstance(value, torch.Tensor):
                self.seen.add(value.device.type)
        return out


def test_the_packed_mask_is_made_on_the_device_of_the_queries(core_attention):
    # the meta device stands in for a GPU: the sequence bounds come on it, as a GPU batch's do,
    # and nothing may be made on the CPU beside them (torch would refuse to mix the two)
    q, k, v = (torch.empty(SEQ, HEADS, HEAD_DIM, device="meta") for _ in range(3))
    bounds = packed([0, 7, SEQ], "meta")
    with Devices() as made:
        out = core_attention(q, k, v, None, packed_seq_params=bounds)
    assert made.seen == {"meta"}
    assert out.device.type == "meta" and out.shape == (SEQ, HEADS * HEAD_DIM)

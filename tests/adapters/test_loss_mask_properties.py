"""Properties of the loss-mask sources on generated input: masks of any shape, dtype and value.

hypothesis, 200 examples with a fixed seed per test. A mask from a block, a block's function or
a plugin is either taken (as float32 weights, the labels' shape) or refused with a
:class:`mtp_hooks.PolicyError` before the forward changes anything; NeMo-RL's batch reader
gives a mask of ``token_mask``'s shape or a ``PolicyError`` naming the key."""

from __future__ import annotations

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import mtp_hooks  # noqa: E402
from mtp_hooks import _loss_masks  # noqa: E402

SETTINGS = settings(max_examples=200, derandomize=True, database=None, deadline=None)
DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.complex64]  # fmt: skip
values = st.floats(allow_nan=True, allow_infinity=True, width=32)
shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


@st.composite
def tensors(draw, shape=shapes):
    size = draw(shape)
    dtype = draw(st.sampled_from(DTYPES))
    n = 1
    for d in size:
        n *= d
    raw = torch.tensor(draw(st.lists(values, min_size=n, max_size=n)), dtype=torch.float64)
    raw = raw.nan_to_num(0.0) if not (dtype.is_floating_point or dtype.is_complex) else raw
    if dtype == torch.bool:
        return raw.reshape(size) != 0
    if not (dtype.is_floating_point or dtype.is_complex):
        info = torch.iinfo(dtype)
        raw = raw.clamp(info.min, info.max)
    return raw.to(dtype).reshape(size)


def acceptable(mask: torch.Tensor, like: torch.Tensor) -> bool:
    if mask.shape != like.shape or mask.is_complex():
        return False
    if mask.dtype == torch.bool:
        return True
    as_float = mask.double()
    return bool(torch.isfinite(as_float).all() and (as_float >= 0).all())


@SETTINGS
@given(mask=tensors(), like_shape=shapes)
def test_a_mask_is_taken_as_float32_weights_of_the_labels_shape_or_refused(mask, like_shape):
    like = torch.zeros(like_shape, dtype=torch.long)
    try:
        weights = _loss_masks.check(mask, "the test", like)
    except mtp_hooks.PolicyError:
        assert not acceptable(mask, like)
        return
    assert acceptable(mask, like)
    assert weights.dtype == torch.float32 and weights.shape == like.shape
    assert torch.equal(weights, mask.to(torch.float32))


@SETTINGS
@given(mask=st.one_of(tensors(), st.lists(st.floats(), max_size=3), st.none(), st.text()))
def test_a_block_refuses_a_bad_mask_when_it_opens_and_opens_nothing(mask):
    before = _loss_masks.context_masks()
    try:
        with mtp_hooks.mtp_loss_mask(mask):
            assert isinstance(mask, torch.Tensor) and not mask.is_complex()
            assert _loss_masks.context_masks()[-1] is mask
    except mtp_hooks.PolicyError:
        pass
    assert _loss_masks.context_masks() == before and _loss_masks.OPEN == [0]


@SETTINGS
@given(
    batch=st.integers(1, 4),
    seq=st.integers(1, 4),
    advantages=tensors(shape=st.lists(st.integers(0, 4), max_size=3).map(tuple)),
    sample_shape=st.sampled_from(["ok", "scalar", "long"]),
)
def test_nemo_rls_batch_reader_gives_a_token_shaped_mask_or_names_the_key(
    batch, seq, advantages, sample_shape
):
    mtp_hooks_nemo = pytest.importorskip("mtp_hooks_nemo")
    samples = {"ok": torch.ones(batch), "scalar": torch.tensor(1.0), "long": torch.ones(batch + 1)}
    data = {
        "token_mask": torch.ones(batch, seq),
        "sample_mask": samples[sample_shape],
        "advantages": advantages.real if advantages.is_complex() else advantages,
    }
    try:
        mask = mtp_hooks_nemo.mtp_loss_mask(data, positive_only=True)
    except mtp_hooks.PolicyError as error:
        assert "'sample_mask'" in str(error) or "'advantages'" in str(error)
        return
    assert sample_shape == "ok" and mask.shape == (batch, seq)
    assert tuple(data["advantages"].shape) in ((batch,), (batch, 1), (batch, seq))

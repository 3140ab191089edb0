"""Per-call MTP loss masks on real models: from a plugin's ``mtp_loss_mask`` hook and from an
``mtp_hooks.mtp_loss_mask`` block, handed to megatron as the forward's ``loss_mask``.

The reference is always megatron itself: the same model called with that mask as its
``loss_mask``. Only the MTP loss sees it; the language-model loss stays bit for bit as it was.
"""

from __future__ import annotations

import inspect
import threading

import pytest
import torch

import mtp_hooks

from model_fixtures import SEQ, guards_empty_masks, has_detach_field, packed_row

pytestmark = pytest.mark.skipif(
    not guards_empty_masks(), reason="masks are refused where megatron divides by zero (0.16)"
)


def masked_step(model, batch, loss_mask=None, **kwargs):
    """A training forward and backward; the per-token loss and every gradient."""
    model.zero_grad(set_to_none=True)
    model.train()
    if loss_mask is not None:
        kwargs["loss_mask"] = loss_mask
    loss = model(*batch.args(), labels=batch.labels, **kwargs)
    loss.sum().backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        (a[n] is None and b[n] is None) or torch.equal(a[n], b[n]) for n in a
    )


def response_only(batch) -> torch.Tensor:
    """A 0/1 mask: the last half of every sequence, as an answer-only SFT mask would be."""
    mask = torch.zeros_like(batch.labels, dtype=torch.float32)
    mask[:, SEQ // 2 :] = 1.0
    return mask


class Masker:
    """A plugin that answers ``mtp_loss_mask`` with ``mask`` and counts its calls."""

    def __init__(self, mask) -> None:
        self.mask, self.calls = mask, 0

    @mtp_hooks.plugins.hookimpl
    def mtp_loss_mask(self, model, phase, loss_mask, labels, input_ids):
        self.calls += 1
        return self.mask


def test_a_plugins_mask_trains_mtp_exactly_as_passing_it_as_loss_mask(build, batch):
    mask = response_only(batch)
    hooked, plain = build(seed=3), build(seed=3)
    mtp_hooks.attach(hooked)
    mtp_hooks.plugins.register(Masker(mask), name="masker")
    loss, grads = masked_step(hooked, batch)
    expected_loss, expected = masked_step(plain, batch, loss_mask=mask)
    assert torch.equal(loss, expected_loss) and same(grads, expected)
    _, unmasked = masked_step(plain, batch)
    assert not same(grads, unmasked)  # the mask changed what MTP trained on


def test_a_mask_block_trains_mtp_exactly_as_passing_it_as_loss_mask(build, batch):
    mask = response_only(batch)
    hooked, plain = build(seed=4), build(seed=4)
    mtp_hooks.attach(hooked)
    with mtp_hooks.mtp_loss_mask(mask):
        loss, grads = masked_step(hooked, batch)
    expected_loss, expected = masked_step(plain, batch, loss_mask=mask)
    assert torch.equal(loss, expected_loss) and same(grads, expected)


def test_a_block_given_a_function_asks_it_at_each_masked_forward_with_the_hooks_arguments(
    build, batch
):
    mask, asked = response_only(batch), []

    def batch_mask(**call):
        asked.append(call)
        return mask

    hooked, plain = build(seed=4), build(seed=4)
    mtp_hooks.attach(hooked)
    mtp_hooks.configure("eval=skip")
    with mtp_hooks.mtp_loss_mask(batch_mask):
        loss, grads = masked_step(hooked, batch)
        with torch.no_grad():
            hooked.eval()
            hooked(*batch.args())  # an eval forward skips MTP: the function is not asked
    expected_loss, expected = masked_step(plain, batch, loss_mask=mask)
    assert torch.equal(loss, expected_loss) and same(grads, expected)
    assert len(asked) == 1 and set(asked[0]) == {
        "model",
        "phase",
        "loss_mask",
        "labels",
        "input_ids",
    }
    assert asked[0]["model"] is hooked and asked[0]["phase"] == "train"
    assert asked[0]["labels"] is batch.labels and asked[0]["loss_mask"] is None


def test_a_block_function_that_answers_none_leaves_the_forward_unmasked(build, batch):
    hooked, plain = build(seed=4), build(seed=4)
    handle = mtp_hooks.attach(hooked)
    with mtp_hooks.mtp_loss_mask(lambda **call: None):
        _, grads = masked_step(hooked, batch)
    _, expected = masked_step(plain, batch)
    assert same(grads, expected) and "masked" not in handle.stats()["train"]


def test_a_bad_mask_from_a_block_function_is_refused_naming_the_function(build, batch, count_mtp):
    model = build()
    counter = count_mtp(model)
    mtp_hooks.attach(model)

    def negative(**call):
        return -torch.ones_like(call["labels"], dtype=torch.float32)

    with mtp_hooks.mtp_loss_mask(negative):
        with pytest.raises(mtp_hooks.PolicyError, match="block's function .*negative.* negative"):
            masked_step(model, batch)
    with mtp_hooks.mtp_loss_mask(lambda **call: [1, 0]):
        with pytest.raises(mtp_hooks.PolicyError, match="block's function .*lambda.* gave list"):
            masked_step(model, batch)
    assert counter.n == 0


def test_plugin_block_and_caller_masks_multiply(build, batch):
    halves = response_only(batch)
    weights = torch.rand(batch.labels.shape, generator=torch.Generator().manual_seed(5))
    odd = (torch.arange(SEQ) % 2).float().expand_as(weights).contiguous()
    hooked, plain = build(seed=6), build(seed=6)
    mtp_hooks.attach(hooked)
    mtp_hooks.plugins.register(Masker(halves.bool()), name="halves")
    with mtp_hooks.mtp_loss_mask(weights), mtp_hooks.mtp_loss_mask(odd):
        _, grads = masked_step(hooked, batch, loss_mask=odd)
    _, expected = masked_step(plain, batch, loss_mask=halves * weights * odd * odd)
    assert same(grads, expected)


def test_the_language_model_loss_and_logits_do_not_see_the_mask(build, batch, count_mtp):
    model = build(seed=7)
    counter = count_mtp(model)
    mtp_hooks.attach(model)
    plain_loss, _ = masked_step(model, batch)
    with mtp_hooks.mtp_loss_mask(torch.zeros_like(batch.labels)):
        masked_loss, grads = masked_step(model, batch)
    assert torch.equal(plain_loss, masked_loss)
    assert counter.n == 2  # MTP ran, and with every position masked out trained on nothing
    assert all(float(g.abs().max()) == 0 for n, g in grads.items() if n.startswith("mtp."))
    model.eval()
    try:
        with torch.no_grad():
            plain_logits = model(*batch.args())
    except AttributeError:  # megatron-core 0.16 runs MTP without labels and fails (labels.clone)
        return
    with torch.no_grad(), mtp_hooks.mtp_loss_mask(torch.zeros_like(batch.labels)):
        assert torch.equal(model(*batch.args()), plain_logits)


def test_a_skipped_forward_ignores_masks_and_asks_no_plugin(build, batch, count_mtp):
    model = build()
    counter = count_mtp(model)
    masker = Masker(torch.full_like(batch.labels, float("nan"), dtype=torch.float32))
    mtp_hooks.attach(model)
    mtp_hooks.plugins.register(masker, name="masker")
    mtp_hooks.configure("train=skip")
    masked_step(model, batch)
    assert masker.calls == 0 and counter.n == 0


@pytest.mark.parametrize(
    "answer, message",
    [
        (
            lambda b: b.labels[:, :-1].float(),
            rf"shape \(2, {SEQ - 1}\); this forward's labels have",
        ),
        (lambda b: torch.ones_like(b.labels, device="meta"), "on meta; this forward's labels"),
        (lambda b: torch.full_like(b.labels, -1.0, dtype=torch.float32), "negative or non-finite"),
        (lambda b: torch.full_like(b.labels, float("inf"), dtype=torch.float32), "non-finite"),
        (lambda b: [1.0] * SEQ, "gave list as an MTP loss mask"),
        (lambda b: torch.ones_like(b.labels, dtype=torch.complex64), "dtype torch.complex64"),
    ],
)
def test_a_bad_plugin_mask_is_refused_naming_the_plugin_and_changes_nothing(
    build, batch, count_mtp, answer, message
):
    model = build()
    counter = count_mtp(model)
    config, process = model.config, model.mtp_process
    mtp_hooks.attach(model)
    mtp_hooks.plugins.register(Masker(answer(batch)), name="bad")
    with pytest.raises(mtp_hooks.PolicyError, match=message) as info:
        masked_step(model, batch)
    assert str(info.value).startswith("plugin 'bad' gave")
    assert counter.n == 0 and model.config is config and model.mtp_process is process
    mtp_hooks.plugins.unregister("bad")
    masked_step(model, batch)
    assert counter.n == 1


def test_a_bad_block_mask_is_refused_when_the_block_opens(batch):
    with pytest.raises(mtp_hooks.PolicyError, match="mtp_loss_mask block gave .* non-finite"):
        with mtp_hooks.mtp_loss_mask(torch.full(batch.labels.shape, float("nan"))):
            pass
    assert mtp_hooks._loss_masks.context_masks() == ()


def test_a_mask_of_the_wrong_shape_in_a_block_is_refused_by_the_forward(build, batch, count_mtp):
    model = build()
    counter = count_mtp(model)
    mtp_hooks.attach(model)
    with mtp_hooks.mtp_loss_mask(torch.ones(3, 3)):
        with pytest.raises(mtp_hooks.PolicyError, match="mtp_loss_mask block gave .* shape"):
            masked_step(model, batch)
    assert counter.n == 0


def test_a_forward_with_an_output_processor_refuses_a_mask(build, batch):
    model = build()
    if "output_processor" not in inspect.signature(type(model).forward).parameters:
        pytest.skip(f"{type(model).__name__}.forward takes no output_processor")
    mtp_hooks.attach(model)
    seen = []

    def processor(**kwargs):
        seen.append(kwargs["loss_mask"])
        return kwargs["hidden_states"]

    with mtp_hooks.mtp_loss_mask(response_only(batch)):
        with pytest.raises(mtp_hooks.UnsupportedModelError, match="output_processor"):
            masked_step(model, batch, output_processor=processor)
    assert seen == []


@pytest.mark.parametrize("raised", [RuntimeError, KeyboardInterrupt])
def test_a_masked_forward_interrupted_inside_mtp_leaves_the_model_as_it_was(build, batch, raised):
    mask = response_only(batch)
    model, plain = build(seed=8), build(seed=8)
    config, process = model.config, model.mtp_process
    mtp_hooks.attach(model)

    def fail(*_):
        raise raised("inside MTP")

    hook = model.mtp.register_forward_pre_hook(fail)
    with mtp_hooks.mtp_loss_mask(mask), pytest.raises(raised):
        masked_step(model, batch)
    hook.remove()
    assert mtp_hooks._loss_masks.context_masks() == ()
    _, grads = masked_step(model, batch)
    _, expected = masked_step(plain, batch)
    assert same(grads, expected)
    assert model.config is config and model.mtp_process is process


@pytest.mark.parametrize("raised", [RuntimeError, KeyboardInterrupt])
def test_a_block_function_that_raises_stops_the_forward_before_it_changes_anything(
    build, batch, count_mtp, raised
):
    model, plain = build(seed=8), build(seed=8)
    counter = count_mtp(model)
    config, process = model.config, model.mtp_process
    mtp_hooks.attach(model)

    def fail(**call):
        raise raised("the framework's batch is gone")

    with mtp_hooks.mtp_loss_mask(fail), pytest.raises(raised):
        masked_step(model, batch)
    assert counter.n == 0 and model.config is config and model.mtp_process is process
    _, grads = masked_step(model, batch)
    _, expected = masked_step(plain, batch)
    assert same(grads, expected)


def test_a_block_applies_to_its_own_thread_only(build, batch):
    mask = response_only(batch)
    model, plain = build(seed=9), build(seed=9)
    mtp_hooks.attach(model)
    seen = {}
    with mtp_hooks.mtp_loss_mask(mask):
        worker = threading.Thread(target=lambda: seen.update(out=masked_step(model, batch)))
        worker.start()
        worker.join()
    _, expected = masked_step(plain, batch)
    assert same(seen["out"][1], expected)


def test_metrics_count_only_the_masked_in_positions(build, batch):
    mask = response_only(batch)
    hooked, plain = build(seed=10), build(seed=10)
    handle = mtp_hooks.attach(hooked)
    mtp_hooks.configure("train=run+metrics")
    with mtp_hooks.mtp_loss_mask(mask):
        masked_step(hooked, batch)
    got = handle.metrics()["train"]
    handle.remove()
    reference = mtp_hooks.attach(plain)
    masked_step(plain, batch, loss_mask=mask)
    expected = reference.metrics()["train"]
    assert got == expected
    assert got.tokens[0] < batch.labels.numel() // 2 + 1


def test_mask_labels_equals_a_hand_built_ignore_index_mask(build, batch):
    labels = batch.labels.clone()
    labels[:, :5] = -100  # a prompt, as answer-only SFT labels it
    labels[0, -3:] = -100  # and padding
    hand_built = (labels != -100).float()
    hooked, plain = build(seed=11), build(seed=11)
    handle = mtp_hooks.attach(hooked)
    mtp_hooks.configure("train=run+mask:labels")
    hooked.zero_grad(set_to_none=True)
    hooked.train()
    hooked(*batch.args(), labels=labels).sum().backward()
    plain.train()
    plain(*batch.args(), labels=labels, loss_mask=hand_built).sum().backward()
    grads = {n: p.grad for n, p in hooked.named_parameters()}
    assert same(grads, {n: p.grad for n, p in plain.named_parameters()})
    assert handle.stats()["train"] == {"run": 1, "masked": 1}


def test_a_configured_ignore_index_is_the_label_left_out(build, batch):
    labels = batch.labels.clone()
    labels[:, :4] = 0
    hooked, plain = build(seed=12), build(seed=12)
    mtp_hooks.attach(hooked)
    mtp_hooks.configure({"train": {"mtp": "run", "mask": "labels", "ignore_index": 0}})
    for model, mask in ((hooked, None), (plain, (labels != 0).float())):
        model.train()
        extra = {} if mask is None else {"loss_mask": mask}
        model(*batch.args(), labels=labels, **extra).sum().backward()
    assert same(
        {n: p.grad for n, p in hooked.named_parameters()},
        {n: p.grad for n, p in plain.named_parameters()},
    )


def test_plugin_masks_false_leaves_plugins_unasked_while_blocks_still_apply(build, batch):
    mask = response_only(batch)
    hooked, plain = build(seed=13), build(seed=13)
    masker = Masker(torch.zeros_like(mask))
    mtp_hooks.attach(hooked)
    mtp_hooks.plugins.register(masker, name="masker")
    mtp_hooks.configure({"train": {"mtp": "run", "plugin_masks": False}})
    with mtp_hooks.mtp_loss_mask(mask):
        _, grads = masked_step(hooked, batch)
    _, expected = masked_step(plain, batch, loss_mask=mask)
    assert masker.calls == 0 and same(grads, expected)


def test_explain_names_every_mask_source(build):
    model = build()
    mtp_hooks.plugins.register(Masker(None), name="masker")
    mtp_hooks.configure("train=run+mask:labels")
    text = mtp_hooks.explain(model, "train")
    assert "MTP loss mask: labels other than -100 (from config); plugins masker" in text
    mtp_hooks.configure({"train": {"mtp": "run", "plugin_masks": False}})
    assert "plugins' masks off (from config)" in mtp_hooks.explain(model, "train")
    decision = mtp_hooks.decide(model, "train")
    assert decision.options.plugin_masks is False and decision.options.mask is None


def test_under_packed_sequences_the_mask_is_rolled_as_megatrons_own_loss_mask():
    from mtp_hooks.demo import tiny_models

    spec = tiny_models.TinySpec(seq_length=SEQ, vocab_size=128)
    models = []
    for _ in range(2):
        torch.manual_seed(14)
        models.append(tiny_models.build_gpt(spec, attention="sdpa"))  # thd-capable on the CPU
    hooked, plain = models
    row = packed_row()  # two sequences in one row
    ids, pos, mask = row.input_ids, row.position_ids, row.loss_mask
    mtp_hooks.attach(hooked)
    grads = []
    for model, block in ((hooked, mask), (plain, None)):
        model.train()
        kwargs = {"packed_seq_params": row.packed, "labels": torch.roll(ids, -1, 1)}
        if block is None:
            kwargs["loss_mask"] = mask
            model(ids, pos, None, **kwargs).sum().backward()
        else:
            with mtp_hooks.mtp_loss_mask(block):
                model(ids, pos, None, **kwargs).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert same(*grads)


@pytest.mark.parametrize("policy", ["train=run:0.5", "train=run+detach", "train=run:0.25+detach"])
def test_under_a_weight_or_detach_a_block_mask_trains_as_passing_it_as_loss_mask(
    build, batch, policy
):
    if "detach" in policy and not has_detach_field():
        pytest.skip("+detach needs mtp_detach_heads (megatron-core 0.19 on)")
    mask = response_only(batch)
    grads = {}
    for how in ("block", "loss_mask", "unmasked", "skip"):
        model = build(seed=15)
        if "detach" in policy:
            mtp_hooks.megatron.clip_mtp_apart(model)
        handle = mtp_hooks.attach(model)
        mtp_hooks.configure("train=skip" if how == "skip" else policy)
        if how == "block":
            with mtp_hooks.mtp_loss_mask(mask):
                _, grads[how] = masked_step(model, batch)
        else:
            _, grads[how] = masked_step(
                model, batch, loss_mask=mask if how == "loss_mask" else None
            )
        handle.remove()
        mtp_hooks.testing.reset()
    assert same(grads["block"], grads["loss_mask"])
    mtp = {n for n in grads["block"] if n.startswith("mtp.")}
    assert any(not torch.equal(grads["block"][n], grads["unmasked"][n]) for n in mtp)
    if "detach" in policy:  # the mask changes what MTP learns, never the trunk's update
        trunk = [n for n in grads["block"] if n not in mtp]
        assert all(same({n: grads["block"][n]}, {n: grads["skip"][n]}) for n in trunk)


def test_blocks_held_by_generators_mask_exactly_their_forwards_whatever_order_they_close_in(
    build, batch
):
    """Two generators each hold a block; the outer one is closed first."""
    outer_mask, inner_mask = response_only(batch), torch.ones_like(batch.labels)
    inner_mask[:, : SEQ // 4] = 0
    model, plain = build(seed=12), build(seed=12)
    mtp_hooks.attach(model)

    def holding(mask):
        with mtp_hooks.mtp_loss_mask(mask):
            yield

    outer, inner = holding(outer_mask), holding(inner_mask)
    next(outer)
    next(inner)
    outer.close()  # the outer block ends while the inner one is still open
    _, grads = masked_step(model, batch)
    assert same(grads, masked_step(plain, batch, loss_mask=inner_mask.float())[1])
    inner.close()
    _, grads = masked_step(model, batch)  # no block is open any more
    assert same(grads, masked_step(plain, batch)[1])
    with mtp_hooks.mtp_loss_mask(inner_mask):  # a later block: the closed ones stay gone
        _, grads = masked_step(model, batch)
    assert same(grads, masked_step(plain, batch, loss_mask=inner_mask.float())[1])
    assert mtp_hooks._loss_masks.context_masks() == ()

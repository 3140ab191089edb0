"""MTP loss and top-1 acceptance per depth outside training (``eval=run+metrics``), on real models.

The reference is megatron's own ``MTPLossLoggingHelper``, which records the same figures for
forwards in training mode: a training-mode forward in the ``eval`` phase must record exactly
what megatron records for it.
"""

from __future__ import annotations

import pytest
import torch

import mtp_hooks
from mtp_hooks import MTPMetrics, PluginError
from mtp_hooks.demo import tiny_models

from engine_reference import sampled_walk
from model_fixtures import SEQ, VOCAB, Paused, deepcopy_model, measured_eval, native

DEPTHS = 2


@pytest.fixture
def deep(build):
    """``deep(seed)``: a model of the current kind with two MTP depths."""
    return lambda seed=0: build(
        seed, spec=tiny_models.TinySpec(seq_length=SEQ, vocab_size=VOCAB, mtp_num_layers=DEPTHS)
    )


@pytest.fixture
def loss_mask(batch) -> torch.Tensor:
    mask = torch.ones_like(batch.labels, dtype=torch.float)
    mask[0, :5] = 0
    mask[1, 9:] = 0
    return mask


class Listener:
    """A plugin that keeps every ``mtp_metrics`` call."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, object, MTPMetrics]] = []

    @mtp_hooks.plugins.hookimpl
    def mtp_metrics(self, model, phase, metrics):
        self.calls.append((model, phase, metrics))


def megatron_log() -> tuple[list[float], list[float] | None]:
    """What megatron's tracker holds: per-depth losses, and acceptance where it records one."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    # megatron-core 0.16 keeps losses under "values", later releases under "loss_values"
    newer = hasattr(MTPLossLoggingHelper, "save_metrics_to_tracker")
    losses = tracker["loss_values"] if newer else tracker["values"]
    if "correct_values" not in tracker or not tracker["total_values"].any():
        return losses.tolist(), None  # megatron-core 0.16 records no acceptance
    return losses.tolist(), (tracker["correct_values"] / tracker["total_values"]).tolist()


def test_a_training_mode_forward_records_exactly_what_megatron_logs(deep, batch, loss_mask):
    tiny_models.reset_mtp_loss_tracker(num_layers=DEPTHS)
    model = deep()
    listener = Listener()
    mtp_hooks.plugins.register(listener)
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("eval=run+metrics")
    model.train()  # megatron logs MTP only in training mode
    with mtp_hooks.phase("eval"):
        model(*batch.args(), labels=batch.labels, loss_mask=loss_mask)
    losses, acceptance = megatron_log()
    [(seen_model, phase, metrics)] = listener.calls
    assert seen_model is model and phase == "eval" and metrics.forwards == 1
    assert list(metrics.loss) == losses  # bit for bit
    assert all(loss > 0 for loss in losses)
    if acceptance is not None:
        assert list(metrics.acceptance) == acceptance
    # each depth rolls labels and mask one position left: row 1 loses its first unmasked one
    assert metrics.tokens == (11 + 8, 11 + 7)
    assert handle.metrics()["eval"].loss == pytest.approx(metrics.loss, rel=1e-6)


def test_an_eval_forward_records_what_a_training_forward_would(deep, batch, loss_mask):
    model = deep()
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("eval=run+metrics,train=run+metrics")
    with torch.no_grad():
        model.eval()
        model(*batch.args(), labels=batch.labels, loss_mask=loss_mask)  # phase eval
        with mtp_hooks.phase("train"):
            model(*batch.args(), labels=batch.labels, loss_mask=loss_mask)
    metrics = handle.metrics()
    assert metrics["eval"] == metrics["train"]
    assert tiny_models.recorded_mtp_loss() == 0  # megatron itself logged nothing in eval mode


def set_head_to_predict(model, token: int) -> None:
    """Make every MTP depth predict ``token`` at every position: each depth's final norm
    outputs the same vector, whose output-layer logits peak at ``token``."""
    weight = model.output_layer.weight if model.output_layer.weight is not None else None
    if weight is None:
        weight = model.shared_embedding_or_output_weight()
    with torch.no_grad():
        for layer in model.mtp.layers:
            layer.final_layernorm.weight.zero_()
            layer.final_layernorm.bias.copy_(weight[token] * 10)
    assert torch.all(weight @ (weight[token] * 10) <= (weight @ (weight[token] * 10))[token])


@pytest.mark.parametrize("token, expected", [(7, 1.0), (8, 0.0)])
def test_acceptance_is_one_for_a_head_that_predicts_every_label(
    deep, batch, loss_mask, token, expected
):
    model = deep()
    set_head_to_predict(model, token)
    handle = measured_eval(model, batch, torch.full_like(batch.labels, 7), loss_mask)
    assert handle.metrics()["eval"].acceptance == (expected,) * DEPTHS


def test_a_weighted_mask_weighs_the_loss_but_acceptance_counts_positions(deep, batch, loss_mask):
    model = deep()
    set_head_to_predict(model, 7)
    listener = Listener()
    mtp_hooks.plugins.register(listener)
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("eval=run+metrics,train=run+metrics")
    labels = torch.full_like(batch.labels, 7)
    weighted = loss_mask.clone()
    weighted[:, ::2] *= 0.5  # every hit position still counts once
    tiny_models.reset_mtp_loss_tracker(num_layers=DEPTHS)
    model.train()
    with mtp_hooks.phase("train"):
        model(*batch.args(), labels=labels, loss_mask=weighted)
    model.eval()  # megatron logs training-mode forwards only: its log holds the one above
    with torch.no_grad(), mtp_hooks.phase("eval"):
        model(*batch.args(), labels=labels, loss_mask=loss_mask)
    got, plain = handle.metrics()["train"], handle.metrics()["eval"]
    assert got.acceptance == (1.0,) * DEPTHS  # was 1.3 when hits were divided by the mask sum
    assert got.chain_acceptance == (1.0,) * DEPTHS
    assert got.accepted_length == plain.accepted_length
    assert got.tokens == plain.tokens == (11 + 8, 11 + 7)  # positions, not the mask's sum
    one_forward = listener.calls[0][2]  # float32, as megatron divides
    assert list(one_forward.loss) == megatron_log()[0]  # megatron's weighted mean, bit for bit


def chained_by_hand(labels, mask, token: int, depths: int) -> tuple[list[float], float, float]:
    """Chained acceptance, the accepted length a greedy engine reaches, and the per-position
    mean chain, for heads that always draft ``token``: depth ``d`` at position ``i`` drafts
    ``labels[i + d]``, present where ``mask[i + d]`` is set. The engine verifies at the first
    position depth 1 has, and from ``i`` goes on at the first such position from
    ``i + chain + 1`` on (the user guide's walk)."""
    rows, seq = labels.tolist(), labels.shape[1]
    weights = mask.tolist()
    chain_hits, chain_present = [0] * depths, [0] * depths
    walk_accepted = walk_steps = 0
    for row, weight in zip(rows, weights, strict=True):
        run, region = [0] * seq, [False] * seq
        for i in range(seq):
            hit = present = True
            for d in range(depths):
                j = i + d + 1
                present = present and j < seq and weight[j] > 0
                hit = hit and present and row[j] == token
                chain_hits[d] += hit
                chain_present[d] += present
                run[i] += hit
                region[i] = region[i] or (d == 0 and present)
        i = 0  # one walk a row, going on after a chain at the next position depth 1 has
        while i < seq:
            if not region[i]:
                i += 1
                continue
            walk_accepted, walk_steps = walk_accepted + run[i], walk_steps + 1
            i += run[i] + 1
    chain = [h / p for h, p in zip(chain_hits, chain_present, strict=True)]
    return chain, walk_accepted / walk_steps, sum(chain_hits) / chain_present[0]


def test_chained_acceptance_and_accepted_length_count_greedy_chains(deep, batch, loss_mask):
    model = deep()
    set_head_to_predict(model, 7)
    labels = torch.full_like(batch.labels, 8)
    labels[0, ::3] = 7  # depth 1 hits a third of the positions, both depths together none
    labels[0, 8:] = 7  # ... except in this run of sevens, where chains are two long
    labels[1, :6] = 7
    handle = measured_eval(model, batch, labels, loss_mask)
    metrics = handle.metrics()["eval"]
    chain, accepted, per_position = chained_by_hand(labels, loss_mask, 7, DEPTHS)
    assert metrics.chain_acceptance[0] == metrics.acceptance[0]
    assert metrics.chain_acceptance == pytest.approx(chain, abs=1e-6)
    assert metrics.accepted_length == pytest.approx(accepted, abs=1e-6)
    assert 0 < chain[1] < chain[0] < 1 and 0 < accepted < DEPTHS  # the case is not trivial
    # the run of sevens makes easy positions follow each other: a mean over every position
    # counts each accepted chain at every position it covers, and reads above the engine
    assert per_position > accepted + 0.05


def test_a_chain_over_a_one_position_hole_in_the_mask_is_walked_once(deep, batch):
    """One masked label (an end-of-document token under eod_mask_loss) leaves depth 1 without
    the position before it, while a chain from two before reaches past it: the walk goes on
    there, and the stretch after the hole starts no walk of its own."""
    model = deep()
    set_head_to_predict(model, 7)
    labels = torch.full_like(batch.labels, 7)
    labels[:, 10:] = 8  # no chain is accepted after the hole: counted twice, it weighs double
    mask = torch.ones_like(labels, dtype=torch.float)
    mask[:, 9] = 0  # the hole: the walk verifies at 0, 3 and 6, whose chain lands on 9
    handle = measured_eval(model, batch, labels, mask)
    _, accepted, _ = chained_by_hand(labels, mask, 7, DEPTHS)
    assert accepted == pytest.approx(6 / 9)  # 2 + 2 + 2 drafts at 0, 3, 6; then 9 to 14
    assert handle.metrics()["eval"].accepted_length == pytest.approx(accepted, abs=1e-6)


def test_running_means_weigh_positions_and_reset_clears_them(deep, batch, loss_mask):
    model = deep()
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("eval=run+metrics")
    listener = Listener()
    mtp_hooks.plugins.register(listener)
    model.eval()
    with torch.no_grad():
        model(*batch.args(), labels=batch.labels, loss_mask=loss_mask)
        model(*batch.args(), labels=batch.labels.flip(-1))  # no mask: more positions
    first, second = (m for _, _, m in listener.calls)
    running = handle.metrics(reset=True)["eval"]
    assert running.forwards == 2 and second.tokens == (30, 28)
    for depth in range(DEPTHS):
        n1, n2 = first.tokens[depth], second.tokens[depth]
        assert running.tokens[depth] == n1 + n2
        mean = (first.loss[depth] * n1 + second.loss[depth] * n2) / (n1 + n2)
        assert running.loss[depth] == pytest.approx(mean, rel=1e-6)
    assert handle.metrics() == {}


def test_without_metrics_in_the_policy_nothing_is_recorded_or_hooked(deep, batch):
    model = deep()
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("eval=run")
    hooks_before = dict(model.mtp._forward_hooks)
    listener = Listener()
    mtp_hooks.plugins.register(listener)
    seen: list[dict] = []
    probe = model.decoder.register_forward_hook(
        lambda *a: seen.append(dict(model.mtp._forward_hooks))
    )
    with torch.no_grad():
        model.eval()
        model(*batch.args(), labels=batch.labels)
    probe.remove()
    assert seen == [hooks_before] and handle.metrics() == {} and listener.calls == []


def test_a_forward_without_labels_measures_against_the_next_input_ids(deep, batch):
    from mtp_hooks.megatron import _capabilities

    if not _capabilities.mtp_loss_derives_labels():
        pytest.skip("this megatron-core computes no MTP loss without labels (0.19 derives them)")
    model = deep()
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("eval=run+metrics")
    with torch.no_grad():
        model.eval()
        model(*batch.args())
        unlabelled = handle.metrics(reset=True)["eval"]
        # what megatron derives: label[i] = input_ids[i + 1], nothing after the window
        labels = torch.cat([batch.input_ids[:, 1:], torch.zeros_like(batch.input_ids[:, :1])], 1)
        window = torch.ones_like(labels, dtype=torch.float)
        window[:, -1] = 0
        model(*batch.args(), labels=labels, loss_mask=window)
    assert unlabelled.tokens == (28, 26)
    assert unlabelled == handle.metrics()["eval"]


def test_metrics_follow_the_role(deep, batch):
    student, teacher = deep(1), deep(2)
    student_handle = mtp_hooks.attach(student, role="student")
    teacher_handle = mtp_hooks.attach(teacher, role="teacher")
    mtp_hooks.configure("eval=run,teacher.eval=run+metrics")
    with torch.no_grad():
        for model in (student, teacher):
            model.eval()
            model(*batch.args(), labels=batch.labels)
    assert student_handle.metrics() == {} and teacher_handle.metrics()["eval"].forwards == 1


def test_a_raising_metrics_plugin_is_named_and_the_model_is_restored(deep, batch):
    class Broken:
        @mtp_hooks.plugins.hookimpl
        def mtp_metrics(self, model, phase, metrics):
            raise RuntimeError("writer closed")

    model = deep()
    shared = model.config
    mtp_hooks.attach(model)
    mtp_hooks.configure("eval=run:0.3+metrics")
    mtp_hooks.plugins.register(Broken(), name="broken-logger")
    model.eval()
    with torch.no_grad(), pytest.raises(PluginError, match="broken-logger.*mtp_metrics"):
        model(*batch.args(), labels=batch.labels)
    assert model.config is shared and model.mtp._forward_hooks == {}


def test_a_forward_that_raises_leaves_no_hook_and_records_nothing(deep, batch):
    model = deep()
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("eval=run+metrics")

    def fail(*args):
        raise RuntimeError("decoder failed")

    failing = model.decoder.register_forward_hook(fail)
    with torch.no_grad(), pytest.raises(RuntimeError, match="decoder failed"):
        model.eval()
        model(*batch.args(), labels=batch.labels)
    failing.remove()
    assert model.mtp._forward_hooks == {} and handle.metrics() == {}


def test_a_skipped_forward_records_nothing(deep, batch):
    model = deep()
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("eval=auto+metrics")

    class SkipEval:
        @mtp_hooks.plugins.hookimpl
        def should_run_mtp(self, model, phase):
            return phase != "eval"

    mtp_hooks.plugins.register(SkipEval())
    with torch.no_grad():
        model.eval()
        model(*batch.args(), labels=batch.labels)
    assert handle.metrics() == {} and handle.stats() == {"eval": {"skip": 1}}


def test_after_ctrl_c_the_next_forward_does_not_record_with_stale_labels(deep, batch):
    model = deep()
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("eval=run+metrics,train=run")
    model.eval()
    interrupt = model.decoder.register_forward_hook(
        lambda *a: (_ for _ in ()).throw(KeyboardInterrupt())
    )
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        model(*batch.args(), labels=batch.labels)  # the recorded forward never ends
    interrupt.remove()
    with torch.no_grad(), mtp_hooks.phase("train"):
        model(*batch.args(), labels=batch.labels)  # runs MTP, records nothing
    assert handle.metrics() == {} and model.mtp._forward_hooks == {}


def test_two_threads_record_the_same_model_at_once(deep, batch):
    model = deep()
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("eval=run+metrics")
    paused = Paused(model, batch, "eval")  # holds a recorded forward inside the decoder
    with torch.no_grad():
        model.eval()
        model(*batch.args(), labels=batch.labels)
    paused.finish()
    alone = handle.metrics(reset=True)["eval"]
    assert alone.forwards == 2 and model.mtp._forward_hooks == {}
    with torch.no_grad():
        model(*batch.args(), labels=batch.labels)
    single = handle.metrics()["eval"]
    assert alone.loss == pytest.approx(single.loss, rel=1e-6) and alone.tokens == tuple(
        2 * n for n in single.tokens
    )


def test_a_deep_copy_starts_with_no_metrics_and_records_its_own(deep, batch):
    model = deep()
    handle = measured_eval(model, batch)
    clone = deepcopy_model(model)
    clone_handle = mtp_hooks.attach(clone)
    assert clone_handle.metrics() == {}
    with torch.no_grad():
        clone(*batch.args(), labels=batch.labels)
    assert clone_handle.metrics() == handle.metrics()
    assert handle.metrics()["eval"].forwards == 1


def test_a_model_with_the_native_flag_records_the_same(build, kind, batch, loss_mask):
    spec = tiny_models.TinySpec(seq_length=SEQ, vocab_size=VOCAB, mtp_num_layers=DEPTHS)
    plain, flagged = build(3, spec=spec), build(3, spec=spec, model_cls=native(kind))
    handles = [mtp_hooks.attach(plain), mtp_hooks.attach(flagged)]
    mtp_hooks.configure("eval=run+metrics")
    with torch.no_grad():
        for model in (plain, flagged):
            model.eval()
            model(*batch.args(), labels=batch.labels, loss_mask=loss_mask)
    assert flagged.received[-1][0] is True  # the flag said "run"
    assert handles[0].metrics() == handles[1].metrics() != {}


def test_models_of_different_depth_on_one_handle_add_up_depth_by_depth(build, deep, batch):
    shallow, two_deep = build(), deep()
    handle = mtp_hooks.attach([shallow, two_deep])
    mtp_hooks.configure("eval=run+metrics")
    listener = Listener()
    mtp_hooks.plugins.register(listener)
    for model in (shallow, two_deep):
        model.eval()
        with torch.no_grad():
            model(*batch.args(), labels=batch.labels)
    (_, _, one), (_, _, two) = listener.calls
    running = handle.metrics()["eval"]
    assert running.forwards == 2 and len(one.loss) == 1 and len(running.loss) == DEPTHS
    assert running.tokens == (one.tokens[0] + two.tokens[0], two.tokens[1])
    mean = (one.loss[0] * one.tokens[0] + two.loss[0] * two.tokens[0]) / running.tokens[0]
    assert running.loss == (pytest.approx(mean, rel=1e-6), pytest.approx(two.loss[1], rel=1e-6))


def test_the_sampled_acceptance_is_the_chance_a_sampled_draft_equals_a_sampled_token(
    deep, batch, loss_mask
):
    """megatron's engine samples its drafts from each depth's distribution q and the target from
    the policy's p, and accepts on equality: chance sum_x q(x) p(x) at the position the depth
    drafts for; a chain with the product along it. Checked against the model's own
    projections, by hand, in float64."""
    model = deep(seed=3)
    hidden: list[torch.Tensor] = []
    probe = model.mtp.register_forward_hook(lambda m, a, out: hidden.append(out.detach()))
    handle = measured_eval(model, batch, loss_mask=loss_mask)
    probe.remove()
    got = handle.metrics()["eval"]

    chunks = torch.chunk(hidden[0], 1 + DEPTHS, dim=0)
    weight = model.output_layer.weight.detach().double()
    policy = torch.softmax(chunks[0].double() @ weight.t(), dim=-1)  # [s, b, v]
    seq = policy.shape[0]
    sums, chain_sums = [0.0] * DEPTHS, [0.0] * DEPTHS
    counts, chain_counts = [0] * DEPTHS, [0] * DEPTHS
    walk_accepted = walk_steps = 0.0
    for b in range(policy.shape[1]):
        reach = [[1.0] + [0.0] * DEPTHS for _ in range(seq)]  # chance of accepting >= n drafts
        for i in range(seq):
            product, present = 1.0, True
            for d in range(1, DEPTHS + 1):
                if i + d >= seq or loss_mask[b, i + d] == 0:
                    present = False
                    continue
                draft = torch.softmax(chunks[d][i, b].double() @ weight.t(), dim=-1)
                p = float((draft * policy[i + d, b]).sum())
                product *= p
                sums[d - 1] += p
                counts[d - 1] += 1
                if present:
                    chain_sums[d - 1] += product
                    chain_counts[d - 1] += 1
                    reach[i][d] = product
        # the sampling engine's walk, never verifying where no draft starts (mask 0 ahead)
        region = [i + 1 < seq and bool(loss_mask[b, i + 1] != 0) for i in range(seq)]
        accepted, steps = sampled_walk(reach, region)
        walk_accepted += accepted
        walk_steps += steps
    want = [s / n for s, n in zip(sums, counts, strict=True)]
    want_chain = [s / n for s, n in zip(chain_sums, chain_counts, strict=True)]
    assert got.sampled_acceptance == pytest.approx(want, rel=1e-4)
    assert got.sampled_chain_acceptance == pytest.approx(want_chain, rel=1e-4)
    assert got.sampled_accepted_length == pytest.approx(walk_accepted / walk_steps, rel=1e-4)
    assert 0 < want_chain[1] < want_chain[0] < 1


def test_a_forward_stopped_before_the_policys_projection_leaves_no_hook_and_records_nothing(
    deep, batch
):
    model = deep(seed=3)
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("eval=run+metrics")
    calls = {"n": 0}

    def stop_at_the_policy(layer, args):
        calls["n"] += 1
        if calls["n"] == DEPTHS + 1:  # megatron's for each depth, then the policy's (ours
            # are made with .forward and reach no hook)
            raise RuntimeError("stopped before the policy's projection")

    stopper = model.output_layer.register_forward_pre_hook(stop_at_the_policy)
    model.eval()
    with torch.no_grad(), pytest.raises(RuntimeError, match="before the policy"):
        model(*batch.args(), labels=batch.labels)
    stopper.remove()
    assert not model.output_layer._forward_hooks and not model.mtp._forward_hooks
    assert "eval" not in handle.metrics()  # the MTP block had returned: still nothing counts
    with torch.no_grad():
        model(*batch.args(), labels=batch.labels)
    assert not model.output_layer._forward_hooks and not model.mtp._forward_hooks
    after = handle.metrics()["eval"]
    assert after.forwards == 1 and after.sampled_accepted_length is not None


@pytest.mark.parametrize("stop", [KeyboardInterrupt, RuntimeError])
def test_a_forward_interrupted_after_the_mtp_block_returned_counts_for_nothing(deep, batch, stop):
    model, alone = deep(seed=4), deep(seed=4)
    handle, reference = mtp_hooks.attach(model), mtp_hooks.attach(alone)
    mtp_hooks.configure("eval=run+metrics")

    def interrupt(layer, args):  # the first depth's output projection, megatron's own
        raise stop("in the first depth's projection")

    stopper = model.output_layer.register_forward_pre_hook(interrupt)
    model.eval()
    alone.eval()
    with torch.no_grad(), pytest.raises(stop):
        model(*batch.args(), labels=batch.labels)
    stopper.remove()
    with torch.no_grad():
        model(*batch.args(), labels=batch.labels)
        alone(*batch.args(), labels=batch.labels)
    got, want = handle.metrics()["eval"], reference.metrics()["eval"]
    assert got.forwards == 1
    assert got == want  # the means of the complete forward alone

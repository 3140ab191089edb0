"""mtp-hooks-bridge on Megatron-Bridge's own forward step, with no edit to Bridge.

``megatron.bridge`` cannot be imported on a CPU machine (its package imports Transformer
Engine), so the functions of ``training/gpt_step.py`` that make a training forward are read
from the installed megatron-bridge wheel and run as they are: ``get_batch_from_iterator``,
``get_batch``, ``_forward_step_common``, ``forward_step`` and ``_create_loss_function``, with
Bridge's own ``masked_next_token_loss``, ``get_packed_seq_params`` and ``get_pg_collection``
loaded from their files. Only two things stand in: ``Tensor.cuda`` (a CUDA allocation) returns
the tensor, and megatron's context-parallel slicing, which Bridge 0.3.1 calls with an older
signature, returns the batch as one CP rank does.
"""

from __future__ import annotations

import ast
import inspect
import logging
from collections.abc import Iterable
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import mtp_hooks
import mtp_hooks_bridge

from bridge_files import bridge_root, load_file
from model_fixtures import SEQ, VOCAB, guards_empty_masks

BRIDGE_FUNCTIONS = (
    "get_batch_from_iterator",
    "get_batch",
    "_forward_step_common",
    "forward_step",
    "_create_loss_function",
)


pytestmark = [
    pytest.mark.skipif(bridge_root() is None, reason="megatron-bridge is not installed"),
    pytest.mark.skipif(not guards_empty_masks(), reason="masks are refused on megatron 0.16"),
]


def load_functions(path: Path, names: tuple[str, ...], namespace: dict) -> SimpleNamespace:
    """The top-level functions ``names`` of the file at ``path``, defined in ``namespace``."""
    tree = ast.parse(path.read_text())
    kept = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {n.name for n in kept} == set(names), "Bridge renamed one: update the list"
    exec(compile(ast.Module(body=kept, type_ignores=[]), str(path), "exec"), namespace)
    return SimpleNamespace(**{name: namespace[name] for name in names})


class GlobalState:
    """Bridge's state class as its annotations name it (only the name is read)."""


@pytest.fixture(scope="module")
def bridge() -> SimpleNamespace:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.utils import is_pp_first_stage, is_pp_last_stage
    from megatron.core.utils import get_model_config, is_te_min_version, unwrap_model

    root = bridge_root()
    namespace = {
        "torch": torch,
        "partial": partial,
        "Iterable": Iterable,
        "logger": logging.getLogger("bridge_gpt_step"),
        "parallel_state": parallel_state,
        "is_pp_first_stage": is_pp_first_stage,
        "is_pp_last_stage": is_pp_last_stage,
        "get_model_config": get_model_config,
        "is_te_min_version": is_te_min_version,
        "unwrap_model": unwrap_model,
        "get_batch_on_this_cp_rank": lambda batch, cp_group=None: batch,  # one CP rank
        "get_pg_collection": load_file(
            root / "training/utils/pg_utils.py", "bridge_pg_utils"
        ).get_pg_collection,
        "get_packed_seq_params": load_file(
            root / "training/utils/packed_seq_utils.py", "bridge_packed_seq_utils"
        ).get_packed_seq_params,
        "masked_next_token_loss": load_file(
            root / "training/losses.py", "bridge_losses"
        ).masked_next_token_loss,
        "GlobalState": GlobalState,
        "ConfigContainer": object,
        "GPTModel": torch.nn.Module,
    }
    step = load_functions(root / "training/gpt_step.py", BRIDGE_FUNCTIONS, namespace)
    step.get_pg_collection = namespace["get_pg_collection"]
    step.get_packed_seq_params = namespace["get_packed_seq_params"]
    injection = load_functions(
        root / "training/utils/train_utils.py",
        ("needs_global_state_injection",),
        {"inspect": inspect, "GlobalState": GlobalState},
    )
    step.needs_global_state_injection = injection.needs_global_state_injection
    return step


@pytest.fixture(autouse=True)
def on_the_cpu(monkeypatch):
    """Bridge moves the batch it pulls to the GPU: here it stays where it is."""
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)


class Timer:
    """Bridge's timers and straggler timer: callables that are context managers too."""

    def __call__(self, *args, **kwargs) -> Timer:
        return self

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def __enter__(self) -> Timer:
        return self

    def __exit__(self, *exc) -> None: ...


STATE = SimpleNamespace(
    timers=Timer(),
    straggler_timer=Timer(),
    cfg=SimpleNamespace(
        dataset=SimpleNamespace(skip_getting_attention_mask_from_dataset=True),
        rerun_state_machine=SimpleNamespace(check_for_nan_in_loss=True, check_for_spiky_loss=False),
    ),
)


def sft_batch(seed: int = 0) -> dict:
    """An answer-only SFT batch as Bridge's datasets give it: labels padded with the EOS id,
    and the prompt and the padding marked only in ``loss_mask``."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (2, SEQ), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    loss_mask = torch.zeros(2, SEQ)
    loss_mask[0, 3 : SEQ - 4] = 1  # the first answer, then padding
    loss_mask[1, 5:] = 1
    tokens[0, SEQ - 3 :] = 0  # EOS as padding
    labels[0, SEQ - 4 :] = 0
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(2, -1).contiguous()
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": position_ids,
    }


def train(step, model, batch: dict) -> tuple[torch.Tensor, dict]:
    """One Bridge training microbatch: ``step``, then Bridge's loss function and backward."""
    model.zero_grad(set_to_none=True)
    model.train()
    output, loss_func = step(STATE, iter([batch]), model)
    loss, _, _ = loss_func(output)
    loss.backward()
    return output.detach(), {n: p.grad for n, p in model.named_parameters()}


def reference(model, batch: dict, loss_mask) -> tuple[torch.Tensor, dict]:
    """The same microbatch with the model given ``loss_mask`` directly (megatron's own way)."""
    model.zero_grad(set_to_none=True)
    model.train()
    kwargs = {} if loss_mask is None else {"loss_mask": loss_mask}
    output = model(
        input_ids=batch["tokens"],
        position_ids=batch["position_ids"],
        attention_mask=None,
        labels=batch["labels"],
        **kwargs,
    )
    torch.sum(output.view(-1).float() * batch["loss_mask"].view(-1)).backward()
    return output.detach(), {n: p.grad for n, p in model.named_parameters()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        (a[n] is None and b[n] is None) or torch.equal(a[n], b[n]) for n in a
    )


def mtp_grads(grads: dict) -> dict:
    return {n: g for n, g in grads.items() if n.startswith("mtp.")}


def test_bridges_forward_step_alone_trains_mtp_on_padding_and_prompt(build, bridge):
    batch = sft_batch()
    model = build(seed=1, attention="sdpa")
    mtp_hooks.attach(model)
    _, grads = train(bridge.forward_step, model, batch)
    _, unmasked = reference(build(seed=1, attention="sdpa"), batch, None)
    _, masked = reference(build(seed=1, attention="sdpa"), batch, batch["loss_mask"])
    assert same(grads, unmasked)
    assert not same(mtp_grads(grads), mtp_grads(masked))


def test_the_wrapped_forward_step_trains_mtp_on_the_batchs_loss_mask(build, bridge):
    batch = sft_batch()
    model = build(seed=2, attention="sdpa")
    handle = mtp_hooks.attach(model)
    step = mtp_hooks_bridge.masked_forward_step(bridge.forward_step)
    output, grads = train(step, model, batch)
    plain = build(seed=2, attention="sdpa")
    expected_output, expected = reference(plain, batch, batch["loss_mask"])
    assert torch.equal(output, expected_output) and same(grads, expected)
    assert handle.stats()["train"]["masked"] == 1


def test_the_wrapped_forward_step_leaves_bridges_language_model_loss_as_it_was(build, bridge):
    batch = sft_batch(seed=3)
    losses = []
    for wrap in (False, True):
        model = build(seed=3, attention="sdpa")
        mtp_hooks.attach(model)
        step = bridge.forward_step
        if wrap:
            step = mtp_hooks_bridge.masked_forward_step(step)
        model.train()
        output, loss_func = step(STATE, iter([batch]), model)
        losses.append((output.detach(), loss_func(output)[0].detach()))
    assert torch.equal(losses[0][0], losses[1][0]) and torch.equal(losses[0][1], losses[1][1])


def test_bridge_passes_its_state_to_the_wrapped_step_as_to_its_own(bridge):
    step = mtp_hooks_bridge.masked_forward_step(bridge.forward_step)
    assert inspect.signature(step) == inspect.signature(bridge.forward_step)
    assert bridge.needs_global_state_injection(step) is True

    def stateless(data_iterator, model):
        return next(data_iterator), None

    assert (
        bridge.needs_global_state_injection(mtp_hooks_bridge.masked_forward_step(stateless))
        is False
    )


def test_a_bridge_that_passes_loss_mask_itself_gets_nothing_added(build, bridge):
    def passing_step(state, data_iterator, model):  # Bridge with loss_mask in forward_args
        tokens, labels, loss_mask, _, position_ids, *_ = bridge.get_batch(
            data_iterator, state.cfg, True, pg_collection=bridge.get_pg_collection(model)
        )
        output = model(tokens, position_ids, None, labels=labels, loss_mask=loss_mask)
        return output, bridge._create_loss_function(loss_mask, False, False)

    batch = sft_batch(seed=4)
    model = build(seed=4, attention="sdpa")
    handle = mtp_hooks.attach(model)
    _, grads = train(mtp_hooks_bridge.masked_forward_step(passing_step), model, batch)
    _, expected = reference(build(seed=4, attention="sdpa"), batch, batch["loss_mask"])
    assert same(grads, expected) and "masked" not in handle.stats()["train"]


def test_labels_sliced_after_the_pull_are_refused_naming_context_parallelism(
    build, bridge, count_mtp
):
    def sliced_step(state, data_iterator, model):  # as a CP rank sees its share of the batch
        tokens, labels, loss_mask, _, position_ids, *_ = bridge.get_batch(
            data_iterator, state.cfg, True, pg_collection=bridge.get_pg_collection(model)
        )
        half = SEQ // 2
        output = model(tokens[:, :half], position_ids[:, :half], None, labels=labels[:, :half])
        return output, None

    model = build(seed=5, attention="sdpa")
    counter = count_mtp(model)
    mtp_hooks.attach(model)
    config, process = model.config, model.mtp_process
    step = mtp_hooks_bridge.masked_forward_step(sliced_step)
    with pytest.raises(mtp_hooks.PolicyError, match="context parallelism"):
        step(STATE, iter([sft_batch()]), model)
    assert counter.n == 0 and model.config is config and model.mtp_process is process


def test_a_batch_without_loss_mask_is_refused_naming_it(build, bridge):
    batch = sft_batch()
    batch["loss_mask"] = None
    model = build(seed=6, attention="sdpa")
    mtp_hooks.attach(model)
    model.train()
    step = mtp_hooks_bridge.masked_forward_step(bridge.forward_step)
    with pytest.raises(mtp_hooks.PolicyError, match="has no 'loss_mask'"):
        step(STATE, iter([batch]), model)


@pytest.mark.parametrize("mask", [[1.0] * SEQ, "all", 1.0])
def test_a_batch_whose_loss_mask_is_not_a_tensor_is_refused_naming_it(build, bridge, mask):
    batch = sft_batch()
    batch["loss_mask"] = mask
    model = build(seed=6, attention="sdpa")
    config, process = model.config, model.mtp_process
    mtp_hooks.attach(model)
    model.train()

    def forward_step(state, data_iterator, model):  # a step that hands the mask on as it is
        pulled = next(data_iterator)
        return model(pulled["tokens"], pulled["position_ids"], None, labels=pulled["labels"])

    step = mtp_hooks_bridge.masked_forward_step(forward_step)
    with pytest.raises(mtp_hooks.PolicyError, match="'loss_mask' of type"):
        step(STATE, iter([batch]), model)
    assert model.config is config and model.mtp_process is process


def test_a_step_without_a_data_iterator_is_refused_when_wrapped():
    def step(state, batches, model):
        return None

    with pytest.raises(TypeError, match=r"step\(state, batches, model\) has no data_iterator"):
        mtp_hooks_bridge.masked_forward_step(step)


def test_packed_sequences_through_bridge_train_mtp_on_the_batchs_loss_mask(bridge):
    from mtp_hooks.demo import tiny_models

    spec = tiny_models.TinySpec(seq_length=SEQ, vocab_size=VOCAB)
    models = []
    for _ in range(2):
        torch.manual_seed(7)
        models.append(tiny_models.build_gpt(spec, attention="sdpa"))  # thd-capable on the CPU
    hooked, plain = models
    g = torch.Generator().manual_seed(8)
    tokens = torch.randint(1, VOCAB, (1, SEQ), generator=g)
    loss_mask = torch.ones(1, SEQ)
    loss_mask[0, :3] = 0  # the first sequence's prompt
    loss_mask[0, 7:10] = 0  # the second's
    batch = {
        "tokens": tokens,
        "labels": torch.roll(tokens, -1, dims=1),
        "loss_mask": loss_mask,
        "position_ids": torch.cat([torch.arange(7), torch.arange(SEQ - 7)]).unsqueeze(0),
        "cu_seqlens": torch.tensor([[0, 7, SEQ, -1]], dtype=torch.int32),
        "cu_seqlens_argmin": torch.tensor(3),
        "max_seqlen": torch.tensor(SEQ - 7),
    }
    mtp_hooks.attach(hooked)
    step = mtp_hooks_bridge.masked_forward_step(bridge.forward_step)
    _, grads = train(step, hooked, dict(batch))
    _, unmasked = train(bridge.forward_step, plain, dict(batch))
    assert not same(mtp_grads(grads), mtp_grads(unmasked))
    plain.zero_grad(set_to_none=True)
    packed = bridge.get_packed_seq_params(
        {k: batch[k] for k in ("cu_seqlens", "cu_seqlens_argmin", "max_seqlen")}
    )
    output = plain(
        tokens, batch["position_ids"], None, labels=batch["labels"], loss_mask=loss_mask,
        packed_seq_params=packed,
    )  # fmt: skip
    torch.sum(output.view(-1).float() * loss_mask.view(-1)).backward()
    assert same(grads, {n: p.grad for n, p in plain.named_parameters()})

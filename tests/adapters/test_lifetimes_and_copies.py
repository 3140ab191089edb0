"""Attached models are freed when dropped, deep copies are attached cleanly, chunks count once."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import mtp_hooks

from model_fixtures import Wrapper, deepcopy_model


@pytest.mark.parametrize("wrap", ["bare", "wrapper", "torch-ddp"])
def test_a_dropped_model_and_handle_free_the_model(build, batch, wrap):
    model = build()
    outer = {
        "bare": lambda m: m,
        "wrapper": Wrapper,
        "torch-ddp": torch.nn.parallel.DistributedDataParallel,
    }[wrap](model)
    handle = mtp_hooks.attach(outer, role="student")
    mtp_hooks.configure("train=skip")
    outer(*batch.args(), labels=batch.labels).sum().backward()
    ref = weakref.ref(model)
    del model, outer, handle
    gc.collect()
    assert ref() is None


def test_a_dropped_model_is_freed_while_its_handle_lives_on(build):
    model = build()
    handle = mtp_hooks.attach(model)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
    assert handle.models == [] and handle.gated == []
    handle.remove()  # harmless once the model is gone


def test_reset_does_not_keep_attached_models_alive(build):
    model = build()
    mtp_hooks.attach(model)
    ref = weakref.ref(model)
    mtp_hooks.testing.reset()
    del model
    gc.collect()
    assert ref() is None


def test_a_deep_copy_is_attached_through_its_own_handle(build, batch, count_mtp):
    model = build()
    handle = mtp_hooks.attach(model, role="teacher")
    mtp_hooks.configure("train=run,teacher.train=skip")
    model(*batch.args(), labels=batch.labels)
    twin = deepcopy_model(model)
    twin_handle = mtp_hooks.attach(twin)
    assert twin_handle is not handle and twin_handle.gated == [twin]
    assert mtp_hooks.role_of(twin) == "teacher"
    counter = count_mtp(twin)
    twin(*batch.args(), labels=batch.labels)
    assert counter.n == 0
    assert twin_handle.stats() == {"train": {"skip": 1}}
    assert handle.stats() == {"train": {"skip": 1}}


def test_removing_a_deep_copys_hooks_leaves_the_original_attached(build, batch, count_mtp):
    model = build()
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip")
    twin = deepcopy_model(model)
    mtp_hooks.remove(twin)
    twin_counter, counter = count_mtp(twin), count_mtp(model)
    twin(*batch.args(), labels=batch.labels)
    model(*batch.args(), labels=batch.labels)
    assert (twin_counter.n, counter.n) == (1, 0)
    assert handle.stats() == {"train": {"skip": 1}}
    assert not twin._forward_pre_hooks and not twin._forward_hooks


def test_a_copy_taken_in_the_middle_of_a_skipped_forward_starts_with_mtp_on(build, batch):
    model = build()
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip,eval=run")
    copies = []
    hook = model.decoder.register_forward_pre_hook(
        lambda m, a: copies.append(deepcopy_model(model)) if not copies else None
    )
    model(*batch.args(), labels=batch.labels)
    hook.remove()
    (twin,) = copies
    twin.eval()
    with torch.no_grad():
        twin(*batch.args(), labels=batch.labels)  # the copy's first forward repairs its gates
    assert twin.mtp_process is True and twin.config.mtp_num_layers == 1
    assert twin.config is twin.decoder.config
    mtp_hooks.remove(twin)
    assert twin.mtp_process is True and twin.config is twin.decoder.config


def test_a_chunk_given_twice_is_gated_once(build, batch, voter):
    model = build()
    handle = mtp_hooks.attach([model, model])
    counting = voter(None, "counting")
    model(*batch.args(), labels=batch.labels)
    assert len(handle.gates) == 1 and len(counting.calls) == 1
    assert handle.stats() == {"train": {"run": 1}}

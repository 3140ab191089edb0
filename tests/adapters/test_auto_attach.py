"""auto_attach(): models built afterwards are gated at their first forward, through wrappers."""

from __future__ import annotations

import pytest
import torch

import mtp_hooks
from mtp_hooks.demo import tiny_models

from model_fixtures import Wrapper, has_detach_field


@pytest.fixture
def auto():
    mtp_hooks.auto_attach()
    yield
    mtp_hooks.auto_attach(False)


def test_a_model_built_after_auto_attach_is_gated_without_attach(auto, build, batch, count_mtp):
    model = build()
    counter = count_mtp(model)
    mtp_hooks.configure("train=skip,eval=run")
    model(*batch.args(), labels=batch.labels)  # the first forward attaches, and is gated
    model.eval()
    with torch.no_grad():
        model(*batch.args(), labels=batch.labels)
    assert counter.n == 1
    assert mtp_hooks.attach(model).stats() == {"eval": {"run": 1}, "train": {"skip": 1}}


def test_models_without_mtp_and_plain_modules_get_no_hook(auto, build):
    without = build(spec=tiny_models.TinySpec(mtp_num_layers=None, seq_length=16))
    linear = torch.nn.Linear(2, 2)
    for module in (without, linear):
        assert not module._forward_pre_hooks and not module._forward_hooks


def test_the_first_forward_attaches_through_the_outermost_wrapper(auto, build, batch):
    model = build()
    outer = Wrapper(torch.nn.parallel.DistributedDataParallel(model))
    mtp_hooks.configure("train=skip")
    outer(*batch.args(), labels=batch.labels).sum().backward()
    (gate,) = mtp_hooks.attach(model).gates
    assert gate.ddp.wrapped  # the torch DDP wrapper was seen: skips feed zero gradients
    assert all(p.grad is not None for p in model.mtp.parameters())


def test_a_wrapper_built_after_the_first_forward_reattaches_through_it(auto, build, batch):
    model = build()
    mtp_hooks.configure("train=skip")
    model(*batch.args(), labels=batch.labels)
    assert not mtp_hooks.attach(model).gates[0].ddp.wrapped
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp(*batch.args(), labels=batch.labels).sum().backward()
    assert mtp_hooks.attach(model).gates[0].ddp.wrapped
    assert all(p.grad is not None for p in model.mtp.parameters())


def test_an_explicit_attach_with_a_role_labels_an_auto_attached_model(auto, build, batch):
    teacher = build()
    teacher(*batch.args(), labels=batch.labels)
    handle = mtp_hooks.attach(teacher, role="teacher")
    mtp_hooks.configure("train=run,teacher.train=skip")
    assert handle.role == "teacher" and mtp_hooks.decide(teacher, "train").run is False


def test_turning_auto_attach_off_stops_watching(build, batch, count_mtp):
    mtp_hooks.auto_attach()
    mtp_hooks.auto_attach(False)
    model = build()
    counter = count_mtp(model)
    mtp_hooks.configure("train=skip")
    model(*batch.args(), labels=batch.labels)
    assert counter.n == 1 and not model._forward_pre_hooks


def test_an_unsupported_model_names_auto_attach_in_its_error(auto, build, batch):
    model = build()
    model.config.mtp_standalone = True  # with +metrics: refused at attach time
    mtp_hooks.configure("eval=run+metrics")
    with pytest.raises(mtp_hooks.UnsupportedModelError, match="MTP_HOOKS_AUTO"):
        model(*batch.args(), labels=batch.labels)
    with pytest.raises(mtp_hooks.UnsupportedModelError, match="MTP_HOOKS_AUTO"):
        model(*batch.args(), labels=batch.labels)  # still watched: refused again, never ungated


@pytest.mark.skipif(
    not has_detach_field(), reason="+detach under megatron's optimizer needs megatron-core 0.19"
)
def test_an_inference_forward_leaves_the_model_to_be_attached_by_its_first_training_forward(
    auto, build, batch, count_mtp
):
    """Megatron-LM's RL loop: the engine's rollouts come first, under local CUDA graphs set on
    the config for inference only; the log-prob and policy forwards run with graphs off."""
    try:
        from megatron.core.inference.utils import InferenceMode
    except ImportError:
        pytest.skip("InferenceMode exists from megatron-core 0.18")
    from test_attach import graphed, toggled_off

    model = graphed(build(), "local")
    # what +detach needs under megatron's clipping optimizer
    mtp_hooks.megatron.clip_mtp_apart(model)
    counter = count_mtp(model)
    mtp_hooks.configure("train=run+detach,eval=skip")  # refused under local training graphs
    model.eval()
    with torch.no_grad(), InferenceMode.active():
        try:
            model(*batch.args(), runtime_gather_output=True)  # a rollout: no refusal
        except mtp_hooks.MTPHooksError:
            raise
        except Exception:  # a CPU inference pass may fail later; only the hooks matter here
            pass
    assert not model._forward_hooks  # not attached yet: an attached model has a post-hook
    toggled_off(model)  # as train_rl.py leaves it for its log-prob and training passes
    with torch.no_grad():
        model(*batch.args(), labels=batch.labels)  # the old log-prob pass: attaches, skips
    model.train()
    model(*batch.args(), labels=batch.labels).sum().backward()
    assert counter.n == 1
    assert mtp_hooks.attach(model).stats() == {
        "eval": {"skip": 1},
        "train": {"run": 1, "detached": 1},
    }

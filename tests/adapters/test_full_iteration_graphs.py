"""Full-iteration CUDA graphs (``cuda_graph_impl="full_iteration"``) on a CPU.

megatron captures the whole forward-backward of a training iteration and of an ``evaluate()``
iteration after ``cuda_graph_warmup_steps`` eager ones, and replays them without running any
hook. The graphs need CUDA; the gate reads the config, and megatron's ``FullCudaGraphWrapper``
keeps what it captured in class attributes, which a test can set to stand for a capture.
tests/gpu/test_full_iteration_capture.py captures for real.
"""

from __future__ import annotations

import copy
import gc

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")
full_cuda_graph = pytest.importorskip("megatron.core.full_cuda_graph")
Wrapper = full_cuda_graph.FullCudaGraphWrapper
if not hasattr(Wrapper, "reset_cuda_graph"):
    pytest.skip("this megatron-core cannot drop a captured graph", allow_module_level=True)

import mtp_hooks  # noqa: E402
from mtp_hooks.framework import cacheable_vote  # noqa: E402

from plugin_answers import answers  # noqa: E402


def full_graphs(model):
    """``model`` with a config of its own that declares full-iteration graphs."""
    model.config = copy.copy(model.config)
    model.config.cuda_graph_impl = "full_iteration"
    return model


@pytest.fixture
def captured(monkeypatch):
    """Stand for megatron having captured its training and validation iterations."""
    # A model an earlier test dropped is freed only by the cycle collector (megatron's modules
    # refer to each other), and its gate follows every change until then: a change here would
    # drop these graphs through it.
    gc.collect()
    for attr in ("cuda_graph", "result", "curr_iteration"):
        monkeypatch.setattr(Wrapper, attr, dict(getattr(Wrapper, attr)))

    def capture() -> None:
        for stage in ("training", "validation"):
            Wrapper.cuda_graph[stage] = object()  # a CUDAGraph, which needs CUDA
            Wrapper.result[stage] = [{"lm loss": 0.0}]
            Wrapper.curr_iteration[stage] = 5

    capture()
    return capture


def test_under_full_iteration_graphs_mtp_in_training_and_not_in_evaluation_works(
    build, batch, count_mtp
):
    model = full_graphs(build())
    counter = count_mtp(model)
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("train=run,eval=skip")
    model(*batch.args(), labels=batch.labels).sum().backward()
    model.eval()
    with torch.no_grad():
        model(*batch.args(), labels=batch.labels)
    assert counter.n == 1 and handle.stats() == {"train": {"run": 1}, "eval": {"skip": 1}}


def test_a_policy_change_drops_the_captured_graphs_so_megatron_captures_again(
    build, batch, captured
):
    model = full_graphs(build())
    mtp_hooks.configure("train=run,eval=skip")
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip,eval=skip")
    assert Wrapper.cuda_graph == {"training": None, "validation": None}
    assert Wrapper.curr_iteration == {"training": 0, "validation": 0}  # eager warm-up again


def change(what: str, model, voter) -> None:
    """One of the changes that a decision depends on."""
    if what == "register":
        voter(None, name="later")
    elif what == "set_role":
        mtp_hooks.set_role(model, "student")
    elif what == "votes_changed":
        mtp_hooks.framework.votes_changed()
    else:
        mtp_hooks.reload()


@pytest.mark.parametrize("what", ["register", "set_role", "votes_changed", "reload"])
def test_every_change_a_decision_depends_on_drops_the_captured_graphs(build, captured, voter, what):
    model = full_graphs(build())
    mtp_hooks.attach(model)
    change(what, model, voter)
    assert Wrapper.cuda_graph["training"] is None


def test_graphs_stay_captured_when_no_full_iteration_model_is_attached(build, captured):
    model, plain = full_graphs(build()), build()
    mtp_hooks.attach(model).remove()
    mtp_hooks.configure("train=skip")
    mtp_hooks.attach(plain)
    mtp_hooks.configure("train=run")
    assert Wrapper.cuda_graph["training"] is not None


def test_a_dropped_model_stops_following_changes(build, captured):
    mtp_hooks.attach(full_graphs(build()))  # the model is freed at once
    mtp_hooks.configure("train=skip")
    assert Wrapper.cuda_graph["training"] is not None


def test_a_reset_drops_the_captured_graphs_and_keeps_the_model_following_changes(build, captured):
    model = full_graphs(build())
    mtp_hooks.attach(model)
    mtp_hooks.testing.reset()  # the policy it clears may have decided what was captured
    assert Wrapper.cuda_graph["training"] is None
    captured()
    mtp_hooks.configure("train=skip")
    assert Wrapper.cuda_graph["training"] is None


def test_a_change_while_megatron_captures_is_refused(build, captured, monkeypatch):
    model = full_graphs(build())
    mtp_hooks.attach(model)
    # test-side stand-in: a CUDA stream that is capturing
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(mtp_hooks.UnsupportedModelError, match="while megatron was capturing"):
        mtp_hooks.configure("train=skip")


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ("train=run,eval=run+metrics", "the policy config asks '+metrics' in eval"),
        ("train=run+metrics", "the policy config asks '+metrics' in train"),
    ],
)
def test_metrics_under_full_iteration_graphs_are_refused_at_attach(build, policy, message):
    model = full_graphs(build())
    config = model.config
    mtp_hooks.configure(policy)
    with pytest.raises(mtp_hooks.UnsupportedModelError) as info:
        mtp_hooks.attach(model)
    assert message in str(info.value) and "no replay runs" in str(info.value)
    assert model.config is config and not model._forward_pre_hooks


def test_a_plugin_asked_at_every_forward_is_refused_at_the_first_forward_after_it_votes(
    build, batch, voter, count_mtp
):
    model = full_graphs(build())
    counter = count_mtp(model)
    mtp_hooks.attach(model)
    voter(False, name="every-forward")
    with pytest.raises(mtp_hooks.UnsupportedModelError) as info:
        model(*batch.args(), labels=batch.labels)
    message = str(info.value)
    assert "plugin(s) every-forward voting in train" in message and "cacheable_vote" in message
    assert counter.n == 0 and model.mtp_process is True


def test_a_cacheable_plugin_vote_is_followed(build, batch, count_mtp):
    class SkipEval:
        @mtp_hooks.plugins.hookimpl
        @cacheable_vote
        def should_run_mtp(self, model, phase):
            return phase != "eval"

    model = full_graphs(build())
    counter = count_mtp(model)
    mtp_hooks.plugins.register(SkipEval(), name="skip-eval")
    mtp_hooks.attach(model)
    model(*batch.args(), labels=batch.labels)
    model.eval()
    with torch.no_grad():
        model(*batch.args(), labels=batch.labels)
    assert counter.n == 1


def test_a_plugin_loss_weight_under_full_iteration_graphs_is_refused(build):
    model = full_graphs(build())
    answers("mtp_loss_scale", 0.3, name="schedule")
    with pytest.raises(mtp_hooks.UnsupportedModelError, match="loss weight of plugin"):
        mtp_hooks.attach(model)
    mtp_hooks.configure("train=run:0.3,eval=run:0.3")  # a weight from the config is constant
    mtp_hooks.attach(model).remove()


def test_detach_under_full_iteration_graphs_is_refused(build):
    model = full_graphs(build())
    if "mtp_detach_heads" not in type(model.config).__dataclass_fields__:
        pytest.skip("+detach needs megatron-core 0.19")
    mtp_hooks.configure("train=run+detach")
    with pytest.raises(mtp_hooks.UnsupportedModelError, match="full_iteration"):
        mtp_hooks.attach(model)


def test_a_watched_policy_file_is_refused_at_attach_with_the_way_to_follow_it(
    build, tmp_path, monkeypatch
):
    policy = tmp_path / "policy.toml"
    policy.write_text('[policy]\ntrain = "run"\n')
    monkeypatch.setenv("MTP_HOOKS_CONFIG", str(policy))
    mtp_hooks.reload()
    model = full_graphs(build())
    config = model.config
    with pytest.raises(mtp_hooks.UnsupportedModelError) as info:
        mtp_hooks.attach(model)
    assert "MTP_HOOKS_CONFIG_POLL=never" in str(info.value) and "reload()" in str(info.value)
    assert model.config is config and not model._forward_pre_hooks


def test_a_policy_file_read_only_by_reload_is_followed_through_reload(
    build, captured, tmp_path, monkeypatch
):
    policy = tmp_path / "policy.toml"
    policy.write_text('[policy]\ntrain = "run"\neval = "skip"\n')
    monkeypatch.setenv("MTP_HOOKS_CONFIG", str(policy))
    monkeypatch.setenv("MTP_HOOKS_CONFIG_POLL", "never")
    mtp_hooks.reload()
    model = full_graphs(build())
    mtp_hooks.attach(model)
    assert Wrapper.cuda_graph["training"] is not None  # nothing changed yet
    policy.write_text('[policy]\ntrain = "skip"\neval = "skip"\n')
    assert mtp_hooks.decide(model, "train").run  # not re-read on its own
    mtp_hooks.reload()
    assert not mtp_hooks.decide(model, "train").run
    assert Wrapper.cuda_graph == {"training": None, "validation": None}


RECORDER = """
from mtp_hooks.plugins import Flag


class Record(Flag):
    name = "record"

    def refusal(self, options, layout):
        if options.record and layout.replayed:
            return "replays run no Python, and +record records in Python. Drop it there"
        return None
"""


def test_a_contributed_option_refuses_a_replayed_phase_at_attach_and_not_the_others(build, install):
    install("mtpx-record", RECORDER, "record", group=mtp_hooks.plugins.OPTIONS_GROUP,
            attribute="Record")  # fmt: skip
    model = full_graphs(build())
    mtp_hooks.configure("train=run+record")
    with pytest.raises(mtp_hooks.UnsupportedModelError) as refused:
        mtp_hooks.attach(model)
    assert str(refused.value) == (
        "mtp_hooks: the policy config asks '+record' in train, but replays run no Python, "
        "and +record records in Python. Drop it there."
    )
    mtp_hooks.configure("train=run,rollout=run+record")  # rollouts are never replayed
    mtp_hooks.attach(model).remove()

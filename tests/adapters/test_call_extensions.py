"""The per-call extension contract, on real models: what the gate promises every kind of
extension (a loss mask, ``+metrics``, ``+objective``, and whatever comes next), observed with
a kind that writes down each call it gets, put into a real phase plan."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

import mtp_hooks
from mtp_hooks import _options
from mtp_hooks.megatron import _phase_plan
from mtp_hooks.megatron._call_extensions import Extensions


class Spy:
    """A kind that writes down each call: (what, the model's mtp_process at the time, ...)."""

    ends = True
    made: list[Spy] = []

    def __init__(self, model: torch.nn.Module, extensions: Extensions) -> None:
        self.calls: list[tuple] = []
        Spy.made.append(self)

    def begin(self, module, plan, args, kwargs, config) -> None:
        self.calls.append(("begin", module.mtp_process, module.config is config, plan.phase))

    def end(self, module, output):
        self.calls.append(("end", module.mtp_process, output is None))
        return None if output is None else output + 1  # an output handed on in its place

    def cancel(self) -> None:
        self.calls.append(("cancel",))

    def drop_all(self) -> None:
        self.calls.append(("drop_all",))


@pytest.fixture
def spied(build, batch):
    """A model whose skipped eval forwards begin and end a :class:`Spy`, through a real plan;
    the arguments of a forward, and its output before the spy was planned in."""
    Spy.made.clear()
    model = build(0)
    mtp_hooks.configure("eval=skip")
    handle = mtp_hooks.attach(model)
    plans = handle.gates[0].plans
    model.eval()
    with torch.no_grad():
        plain = model(*batch.args())  # plans the phase, and caches the plan
    (phase,) = plans.cache
    plans.cache[phase] = dataclasses.replace(plans.cache[phase], extensions=(Spy,))
    yield model, handle, batch.args(), plain
    handle.remove()


def test_an_extension_begins_before_the_gates_change_and_ends_after_they_are_back(spied):
    model, _, args, _ = spied
    config = model.config
    with torch.no_grad():
        model(*args)
    (spy,) = Spy.made
    # begun with the model's own config and mtp_process (before the skip), ended with them back
    assert spy.calls == [("begin", True, True, "eval"), ("end", True, False)]
    assert model.mtp_process is True and model.config is config


def test_the_output_an_extension_hands_on_is_what_the_forward_returns(spied):
    model, _, args, plain = spied
    with torch.no_grad():
        given = model(*args)
    # the same skipped forward before the spy was planned in: what the model itself returned
    assert torch.equal(given, plain + 1)


def test_a_forward_that_raised_ends_its_extensions_with_no_output(spied):
    model, _, args, _ = spied

    def fail(*hook_args):
        raise ValueError("stopped in the trunk")

    stop = model.decoder.register_forward_pre_hook(fail)
    with pytest.raises(ValueError), torch.no_grad():
        model(*args)
    stop.remove()
    (spy,) = Spy.made
    assert spy.calls == [("begin", True, True, "eval"), ("end", True, True)]


def test_a_call_ctrl_c_interrupted_is_cancelled_at_the_next_call_and_removal_drops_the_rest(
    spied,
):
    model, handle, args, _ = spied

    def interrupt(*hook_args):
        raise KeyboardInterrupt

    stop = model.decoder.register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt), torch.no_grad():
        model(*args)  # torch calls no always_call hook for a KeyboardInterrupt
    stop.remove()
    (spy,) = Spy.made
    assert spy.calls == [("begin", True, True, "eval")]
    with torch.no_grad():
        model(*args)
    assert spy.calls[1:] == [("cancel",), ("begin", True, True, "eval"), ("end", True, False)]
    handle.remove()
    assert spy.calls[-1] == ("drop_all",)


def test_threads_making_a_kinds_first_extension_at_once_share_one():
    class Slow:
        ends = False

        def __init__(self, model, extensions) -> None:
            time.sleep(0.01)  # wide enough for every thread to arrive before the first is done

    extensions = Extensions(threading.Lock())
    made = []
    barrier = threading.Barrier(8)

    def first_call() -> None:
        barrier.wait()
        made.append(extensions.made(Slow, None))

    threads = [threading.Thread(target=first_call) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(made) == 8 and len({id(m) for m in made}) == 1
    assert extensions.ending == []  # a kind with nothing to end is not asked at every end


class Echo(_options.Flag):
    """docs/contributing.md's made-up ``+echo``: a flag whose plan begins an extension."""

    name = "echo"
    extension = f"{__name__}:Spy"

    def plan(self, options, implements):
        return _options.PlanPart(extension=True) if options.echo else _options.NOTHING


@pytest.fixture
def with_echo(monkeypatch):
    """``+echo`` as docs/contributing.md adds it: its class, which names its kind."""
    monkeypatch.setattr(_options, "OPTIONS", (*_options.OPTIONS, Echo()))
    Spy.made.clear()


def test_a_new_option_begins_and_ends_its_extension_from_its_class_alone(with_echo, build, batch):
    model = build(0)
    mtp_hooks.configure("train=run+echo,eval=skip")
    handle = mtp_hooks.attach(model)
    model.train()
    model(*batch.args(), labels=batch.labels)
    model.eval()
    with torch.no_grad():
        model(*batch.args())  # eval skips: no echo
    (spy,) = Spy.made
    # begun by the training call alone; a made kind is ended at every later call (a no-op
    # where the call did not begin it)
    assert [call for call in spy.calls if call[0] == "begin"] == [("begin", True, True, "train")]
    assert spy.calls[1] == ("end", True, False)
    handle.remove()


@pytest.mark.parametrize("extension", ["", "no_such_module:Spy", f"{__name__}:NoSuchKind"])
def test_a_new_option_whose_extension_does_not_import_is_refused_naming_the_fix(
    with_echo, monkeypatch, build, batch, extension
):
    monkeypatch.setattr(Echo, "extension", extension)
    model = build(0)
    mtp_hooks.configure("train=run+echo")
    handle = mtp_hooks.attach(model)
    model.train()
    fix = r"option 'echo' asks for a per-call extension.*set Echo\.extension"
    with pytest.raises(LookupError, match=fix):
        model(*batch.args(), labels=batch.labels)
    assert model.mtp_process is True and Spy.made == []
    handle.remove()


# An option and its extension from a distribution of their own, written with public names only
COUNTER = """
from mtp_hooks.megatron import CallExtension
from mtp_hooks.plugins import NOTHING, Flag, PlanPart


class Counter:
    ends = True
    made = []

    def __init__(self, model, extensions):
        self.begun = self.ended = 0
        Counter.made.append(self)

    def begin(self, module, plan, args, kwargs, config):
        self.begun += 1
        self.phase = plan.phase

    def end(self, module, output):
        self.ended += 1

    def cancel(self):
        pass

    def drop_all(self):
        pass


class Count(Flag):
    name = "count"
    extension = "mtpx_count:Counter"

    def plan(self, options, implements):
        return PlanPart(extension=True) if options.count else NOTHING


ACCEPTED: CallExtension = Counter(None, None)  # the protocol, as mypy reads it
Counter.made.clear()
"""


def test_an_option_and_its_extension_from_an_installed_distribution_run_on_a_real_model(
    install, build, batch
):
    import sys

    install(
        "mtpx-count", COUNTER, "count", group=mtp_hooks.plugins.OPTIONS_GROUP, attribute="Count"
    )
    model = build(0)
    mtp_hooks.configure("train=run+count,eval=skip")
    handle = mtp_hooks.attach(model)
    model.train()
    for _ in range(2):
        model(*batch.args(), labels=batch.labels)
    model.eval()
    with torch.no_grad():
        model(*batch.args())
    (counter,) = sys.modules["mtpx_count"].Counter.made
    assert (counter.begun, counter.ended, str(counter.phase)) == (2, 3, "train")
    handle.remove()


def test_every_option_that_names_an_extension_names_a_kind_that_imports():
    named = [option for option in _options.OPTIONS if option.extension]
    assert {option.name for option in named} == {"mask", "metrics", "objective"}
    assert all(callable(kind) for kind in _phase_plan.kinds(named))


def test_a_call_begins_the_kinds_that_prepare_it_before_those_that_read_it():
    options = {option.name: option for option in _options.OPTIONS}
    asked = [options["metrics"], options["objective"], options["mask"]]
    assert [kind.__name__ for kind in _phase_plan.kinds(asked)] == [
        "LossMasks",
        "Recorder",
        "Objectives",
    ]


def test_a_contributed_option_whose_plan_raises_is_named_and_leaves_the_model_as_it_was(
    install, build, batch
):
    failing = COUNTER + "\n\ndef plan(self, options, implements):\n    return 1 / 0\n\n"
    install(
        "mtpx-count",
        failing + "Count.plan = plan\n",
        "count",
        group=mtp_hooks.plugins.OPTIONS_GROUP,
        attribute="Count",
    )
    model = build(0)
    mtp_hooks.configure("train=run+count")
    handle = mtp_hooks.attach(model)
    model.train()
    before = {name: value for name, value in vars(model).items() if not name.startswith("_")}
    with pytest.raises(mtp_hooks.PluginError) as named:
        model(*batch.args(), labels=batch.labels)
    assert "distribution mtpx-count 1.0" in str(named.value)
    assert "its plan raised ZeroDivisionError" in str(named.value)
    after = {name: value for name, value in vars(model).items() if not name.startswith("_")}
    assert after == before and model.mtp_process is True
    handle.remove()

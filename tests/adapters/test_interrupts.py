"""A forward interrupted at the worst moment leaves the model as promised.

torch runs ``always_call`` forward hooks for ``Exception`` only. After a ``KeyboardInterrupt`` or
``SystemExit`` escapes a skipped forward, the gates are restored by the model's next forward, by
``handle.remove()`` or by ``detach()``.
"""

from __future__ import annotations

import threading

import pytest
import torch

import mtp_hooks


def interrupt_inside_forward(model, batch, exc: BaseException) -> None:
    """Run one training forward of ``model`` that ``exc`` interrupts after the decoder."""
    hook = model.decoder.register_forward_hook(lambda *a: (_ for _ in ()).throw(exc))
    try:
        with pytest.raises(type(exc)):
            model(*batch.args(), labels=batch.labels)
    finally:
        hook.remove()


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), SystemExit(1)], ids=["ctrl-c", "exit"])
def test_the_forward_after_an_interrupt_runs_mtp_again(build, batch, count_mtp, exc):
    model = build()
    shared = model.config
    counter = count_mtp(model)
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip")
    interrupt_inside_forward(model, batch, exc)
    mtp_hooks.configure("train=run")
    seen = []
    model.decoder.register_forward_pre_hook(
        lambda m, a: seen.append((model.mtp_process, model.config is shared))
    )
    model(*batch.args(), labels=batch.labels).sum().backward()
    assert seen == [(True, True)] and counter.n == 1
    assert model.mtp_process is True and model.config is shared
    assert handle.gates[0].records == []


def test_remove_after_an_interrupt_restores_the_gates(build, batch):
    model = build()
    mtp_process, config = model.mtp_process, model.config
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip")
    interrupt_inside_forward(model, batch, KeyboardInterrupt())
    handle.remove()
    assert model.mtp_process is mtp_process and model.config is config
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_removing_the_hooks_after_an_interrupt_restores_the_gates(build, batch):
    model = build()
    config = model.config
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip")
    interrupt_inside_forward(model, batch, KeyboardInterrupt())
    mtp_hooks.remove(model)
    assert model.mtp_process is True and model.config is config


def test_an_interrupt_in_a_nested_teacher_leaves_the_student_consistent(build, batch, count_mtp):
    student, teacher = build(seed=1), build(seed=2)
    s_cfg, t_cfg = student.config, teacher.config
    mtp_hooks.attach(student, role="student")
    mtp_hooks.attach(teacher, role="teacher")
    mtp_hooks.configure("train=skip,teacher.train=skip")
    interrupt_inside_forward(teacher, batch, KeyboardInterrupt())
    s_count = count_mtp(student)
    mtp_hooks.configure("train=run,teacher.train=skip")
    student(*batch.args(), labels=batch.labels)
    teacher.eval()
    with torch.no_grad():
        teacher(*batch.args(), labels=batch.labels)
    assert s_count.n == 1
    assert student.config is s_cfg and teacher.config is t_cfg
    assert teacher.mtp_process is True


def test_remove_restores_the_role_given_before_attach(build):
    model = build()
    mtp_hooks.set_role(model, "teacher")
    mtp_hooks.attach(model).remove()
    assert mtp_hooks.role_of(model) == "teacher"


def test_remove_restores_a_role_that_attach_overrode(build, batch):
    model = build()
    mtp_hooks.set_role(model, "teacher")
    mtp_hooks.attach(model, role="student").remove()
    assert mtp_hooks.role_of(model) == "teacher"
    mtp_hooks.configure("train=run,teacher.train=skip")
    assert mtp_hooks.decide(model, "train").run is False


def test_remove_clears_a_role_that_only_attach_gave(build):
    model = build()
    mtp_hooks.attach(model, role="student").remove()
    assert mtp_hooks.role_of(model) is None


@pytest.mark.parametrize("how", ["mtp_hooks.remove", "handle.remove"])
def test_a_plugin_that_removes_the_hooks_while_deciding_leaves_one_consistent_forward(
    build, batch, how
):
    model = build()
    config = model.config
    handle = mtp_hooks.attach(model)

    class Remover:
        @mtp_hooks.plugins.hookimpl
        def should_run_mtp(self, model, phase):
            mtp_hooks.remove(model) if how == "mtp_hooks.remove" else handle.remove()
            return False

    mtp_hooks.plugins.register(Remover(), name="remover")
    seen = []
    model.decoder.register_forward_pre_hook(
        lambda m, a: seen.append((model.mtp_process, model.config is config))
    )
    model(*batch.args(), labels=batch.labels)
    assert seen == [(True, True)]  # the gate was gone before it changed anything
    assert model.mtp_process is True and model.config is config
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_remove_in_the_middle_of_a_skipped_forward_waits_for_it_to_return(build, batch):
    model = build()
    config = model.config
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip")
    seen = []

    def remove_then_look(module, args, output):
        handle.remove()
        seen.append((model.mtp_process, model.config is config))

    model.decoder.register_forward_hook(remove_then_look)
    model(*batch.args(), labels=batch.labels)
    assert seen == [(False, False)]  # still the skipped state: no flip half-way
    assert model.mtp_process is True and model.config is config
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_a_call_interrupted_in_a_thread_that_has_ended_is_repaired_by_another(build, batch):
    model = build()
    shared = model.config
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip")
    worker = threading.Thread(
        target=interrupt_inside_forward, args=(model, batch, KeyboardInterrupt())
    )
    worker.start()
    worker.join(60)
    assert model.mtp_process is False or model.config is not shared  # left skipped
    mtp_hooks.configure("train=run")
    seen = []
    model.decoder.register_forward_pre_hook(
        lambda m, a: seen.append((model.mtp_process, model.config is shared))
    )
    model(*batch.args(), labels=batch.labels)
    assert seen == [(True, True)] and handle.gates[0].records == []

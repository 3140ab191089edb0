"""Test plugins made to order, and a stand-in for a model where only a role matters.

``answers("mtp_loss_scale", 0.3)`` is a plugin whose one hook answers 0.3; the hand-written
plugin classes of one method each that the tests used to repeat are all this.
"""

from __future__ import annotations

import types
from typing import Any

from mtp_hooks import hookspecs
from mtp_hooks.plugins import hookimpl, register


class Model:
    """Any weak-referenceable object can carry a role; decide() never looks inside it."""


class Answers:
    """A plugin that answers ``value`` from one hook (raises it, if it is an exception) and
    records the arguments of each call in ``calls``. Change ``value`` to change the answer."""

    def __init__(self, value: Any):
        self.value = value
        self.calls: list[tuple[Any, ...]] = []

    def answer(self, *arguments: Any) -> Any:
        self.calls.append(arguments)
        if isinstance(self.value, BaseException):
            raise self.value
        return self.value

    def should_run_mtp(self, model, phase):
        return self.answer(model, phase)

    def mtp_loss_scale(self, model, phase):
        return self.answer(model, phase)

    def mtp_detach_heads(self, model, phase):
        return self.answer(model, phase)

    def mtp_objective(self, model, phase):
        return self.answer(model, phase)

    def mtp_loss_mask(self, model, phase, loss_mask, labels, input_ids):
        return self.answer(model, phase, loss_mask, labels, input_ids)

    def mtp_metrics(self, model, phase, metrics):
        return self.answer(model, phase, metrics)

    def declare_phases(self):
        return self.answer()


HOOKS = [name for name in vars(Answers) if hasattr(hookspecs, name)]


def answers(hook: str, value: Any, name: str | None = None) -> Answers:
    """A plugin whose ``hook`` answers ``value``; registered under ``name`` when one is given.

    Only ``hook`` carries the ``hookimpl`` marker, on a function of the plugin's own class, so
    the plugin takes part in that one hook.
    """
    method = getattr(Answers, hook)
    marked = hookimpl(
        types.FunctionType(method.__code__, method.__globals__, hook, method.__defaults__)
    )
    plugin = type(f"Answers_{hook}", (Answers,), {hook: marked})(value)
    if name is not None:
        register(plugin, name=name)
    return plugin

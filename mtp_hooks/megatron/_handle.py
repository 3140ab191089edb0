"""The handle :func:`mtp_hooks.attach` returns (the table of attached models is the runtime's:
``_runtime.process.attached``).

torch is imported for annotations only, so importing this module imports neither torch nor
megatron-core.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, cast

from .. import _roles, _runtime
from .._metrics import MTPMetrics

if TYPE_CHECKING:
    import torch

    from ._gate import MTPGate


class AttachHandle:
    """The hooks :func:`attach` installed; remove them with :meth:`remove`.

    The handle refers to its models weakly: dropping a model frees it, hooks and all, even
    while the handle lives on.

    Attributes:
        role: The role given at attach time, or ``None``.
    """

    def __init__(
        self,
        models: list[torch.nn.Module],
        gates: list[MTPGate],
        role: str | None,
        prior_roles: list[str | None],
    ):
        self._models = [weakref.ref(m) for m in models]
        self._prior_roles = prior_roles
        self.gates = gates
        self.role = role

    @property
    def models(self) -> list[torch.nn.Module]:
        """The language models found (with or without MTP on this rank) that are still alive."""
        return [m for ref in self._models if (m := ref()) is not None]

    @property
    def gated(self) -> list[torch.nn.Module]:
        """The subset that carries MTP on this rank and is gated."""
        return [m for gate in self.gates if (m := gate.model) is not None]

    def stats(self) -> dict[str, dict[str, float]]:
        """Counts of MTP runs and skips by phase, summed over the gated models, of the runs that
        detached MTP (``"detached"``) and of those whose MTP loss got a mask from mtp-hooks
        (``"masked"``: ``+mask:labels``, a plugin's ``mtp_loss_mask`` or an
        :func:`mtp_hooks.mtp_loss_mask` block), and the loss weight (``"loss_scale"``) the last
        weighted forward of a phase used.

        They count decisions, taken as each forward starts: a forward that raises or is
        interrupted after its decision still counts as a run (or skip, or detached run). Count
        completed steps in your own loop where that difference matters.

        Example: ``{"train": {"run": 3, "detached": 3, "loss_scale": 0.3}, "eval": {"skip": 1}}``.
        After :meth:`remove` the handle gates nothing, and this is ``{}``.
        """
        from ._phase_counters import COUNTED

        out: dict[str, dict[str, float]] = {}
        for gate in self.gates:
            for phase, counters in gate.plans.counts.items():
                seen = out.setdefault(str(phase), {})
                for what, n in zip(COUNTED, counters, strict=True):
                    if n:
                        seen[what] = seen.get(what, 0) + n
            for phase, scale in gate.loss_scales.items():
                out.setdefault(str(phase), {})["loss_scale"] = scale
        return {phase: seen for phase, seen in sorted(out.items()) if seen}

    def metrics(self, reset: bool = False) -> dict[str, MTPMetrics]:
        """MTP loss and top-1 acceptance per depth, as running means by phase, over the forwards
        that recorded them (a ``+metrics`` policy entry, e.g. ``eval=run+metrics``).

        Args:
            reset: Clear the running means after reading them (e.g. at each log interval).

        Example: ``{"eval": MTPMetrics(loss=(2.31,), acceptance=(0.42,), tokens=(4096,),
        forwards=8)}``. Reading waits for the device once; recording never does.
        """
        from .drafting import _recorder

        made = (gate.extensions.get(_recorder.Recorder) for gate in self.gates)
        recorders = [cast(_recorder.Recorder, r) for r in made if r is not None]
        return _recorder.running_means(recorders, reset)

    def remove(self) -> None:
        """Remove every hook and restore each model's role from before :func:`attach`.

        The models are then exactly as before :func:`attach`; a forward of one of them that is
        running right now (in a plugin, a submodule hook or another thread) restores it when it
        returns.
        """
        for gate in self.gates:
            gate.remove()
        with _runtime.process.auto.lock:  # two threads removing it: one puts the roles back
            for ref, prior in zip(self._models, self._prior_roles, strict=True):
                model = ref()
                if model is None:
                    continue
                attached = _runtime.process.attached
                if attached.get(model) is self:
                    del attached[model]
                    if self.role is not None and _roles.role_of(model) == self.role:
                        _roles.set_role(model, prior)
            self.gates = []

    def __enter__(self) -> AttachHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        names = ", ".join(type(m).__name__ for m in self.gated)
        return f"<AttachHandle gating {names or self._why_nothing()} role={self.role!r}>"

    def _why_nothing(self) -> str:
        # attach() of a model without MTP is no error (a pipeline stage without the MTP block,
        # a framework that attaches whatever it builds), so the handle says why it gates nothing
        models = [m for m in self.models if _runtime.process.attached.get(m) is self]
        if not models:
            return "nothing (removed, or its models are gone)"
        depths = {getattr(getattr(m, "config", None), "mtp_num_layers", None) for m in models}
        if depths <= {None, 0}:
            kind = type(models[0]).__name__
            return f"nothing ({kind} was built without MTP: mtp_num_layers unset)"
        return "nothing (no MTP block on this pipeline stage)"

"""``attach``/``detach``: install the MTP gate on every language model inside a (wrapped) model.

torch and megatron-core are imported when a model is attached, not when this module is, so
``from mtp_hooks import *`` works on a core-only install.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

from .. import _env, _roles, _runtime
from .._errors import UnsupportedModelError
from ._handle import AttachHandle

if TYPE_CHECKING:
    from ._gate import MTPGate

ENV_VERIFY = "MTP_HOOKS_VERIFY"


def _adapters() -> tuple[ModuleType, ModuleType, type[MTPGate]]:
    try:
        from . import _capabilities, _ddp_settling
        from ._gate import MTPGate
    except ImportError as exc:
        raise UnsupportedModelError(
            f"mtp_hooks.attach needs torch and megatron-core ({exc}); install them with "
            "pip install 'mtp-hooks[megatron]'"
        ) from exc
    return _capabilities, _ddp_settling, MTPGate


def attach(model: Any, *, role: str | None = None, verify: bool | None = None) -> AttachHandle:
    """Make ``model`` consult ``should_run_mtp`` and the policy config at every forward call.

    Args:
        model: A ``GPTModel``/``HybridModel``/``MambaModel``, a wrapper of one with a ``.module``
            chain (Megatron DDP, Float16Module, torch DDP), or a list of virtual-pipeline chunks
            (a chunk given twice is gated once). Chunks without MTP on this rank are accepted
            and left untouched. Pass the DDP wrapper when it uses ``overlap_param_gather`` so
            skipped forwards can settle its gathers.
        role: A role (``"teacher"``, ``"student"``) for ``ROLE.PHASE`` config keys and plugins;
            defaults to a role already given to ``model`` with :func:`mtp_hooks.set_role`.
            :meth:`AttachHandle.remove` puts back the role each model had before.
        verify: Check each decision across ranks (one small all-gather per forward); defaults
            to the ``MTP_HOOKS_VERIFY`` environment variable.

    Returns:
        An :class:`AttachHandle`. Attaching an already attached model returns its handle (and
        gives it ``role`` if it had none, as after :func:`mtp_hooks.auto_attach`). A
        ``copy.deepcopy`` of an attached model is attached through a handle of its own (find it
        with ``attach(copy)``), with the same role and fresh stats.

    Raises:
        UnsupportedModelError: An unsupported type, a compiled model, or a Megatron mode that
            bypasses forward hooks. The model is left untouched.

    Example:
        .. code-block:: python

            handle = mtp_hooks.attach(model, role="student")
            mtp_hooks.configure("train=run,eval=skip,rollout=skip")
            handle.remove()
    """
    capabilities, settling, gate_cls = _adapters()
    models, wrappers = capabilities.unwrap(model)
    if role is None and not isinstance(model, (list, tuple)):
        role = _roles.role_of(model)  # a role set on the wrapper applies to the model inside
    with _runtime.process.auto.lock:  # two threads attaching one model: one gates it
        return _attach(models, wrappers, role, verify, capabilities, settling, gate_cls)


def _attach(
    models: list[Any],
    wrappers: Any,
    role: str | None,
    verify: bool | None,
    capabilities: Any,
    settling: Any,
    gate_cls: Any,
) -> AttachHandle:
    """:func:`attach`'s work, under the runtime's attach lock."""
    attached = _runtime.process.attached
    existing = {id(h): h for m in models if (h := attached.get(m)) is not None}
    if existing:
        handle: AttachHandle = next(iter(existing.values()))
        if len(existing) > 1 or set(map(id, handle.models)) != set(map(id, models)):
            raise UnsupportedModelError(
                "mtp_hooks.attach: some of these model chunks are already attached through "
                "another handle; detach them first"
            )
        if role is not None and handle.role is None:  # e.g. attached automatically
            _roles.check_role(role, "mtp_hooks.attach")
            handle.role = role
            for m in models:
                _roles.set_role(m, role)
        elif role is not None and role != handle.role:
            raise UnsupportedModelError(
                f"mtp_hooks.attach: model already attached with role {handle.role!r}; call "
                f"handle.remove() before attaching it with role {role!r}"
            )
        return handle
    if verify is None:
        verify = _env.flag(ENV_VERIFY)
    if role is not None:
        _roles.check_role(role, "mtp_hooks.attach")
    # Build every gate (which validates the config) before changing anything on the models.
    gated = [m for m in models if capabilities.gated(m)]
    gates = [gate_cls(m, settling.DDPState(m, wrappers), verify) for m in gated]
    from ._phase_plan import check_policy

    for gate, m in zip(gates, gated, strict=True):  # what the model's mode cannot follow
        check_policy(gate.plans, m, role if role is not None else _roles.role_of(m))
    prior_roles = [_roles.role_of(m) for m in models]
    if role is not None:
        for m in models:
            _roles.set_role(m, role)
    for gate in gates:
        gate.on_copy = _adopter(role)
        gate.install()
    handle = AttachHandle(models, gates, role, prior_roles)
    for m in models:
        attached[m] = handle
    return handle


def _adopter(role: str | None) -> Callable[[MTPGate], None]:
    """What a gate calls when its model is deep-copied: give the copy a handle of its own."""

    def adopt(gate: MTPGate) -> None:
        copy = gate.model
        assert copy is not None
        _runtime.process.attached[copy] = AttachHandle([copy], [gate], role, [None])
        if role is not None:
            _roles.set_role(copy, role)

    return adopt


def remove(model: Any) -> None:
    """Remove the hooks :func:`attach` installed on ``model`` (a no-op if it is not attached):
    what :meth:`AttachHandle.remove` does, for a caller that kept no handle."""
    capabilities, _, _ = _adapters()
    models, _ = capabilities.unwrap(model)
    attached = _runtime.process.attached
    for handle in {id(h): h for m in models if (h := attached.get(m))}.values():
        handle.remove()


def freeze_mtp(model: Any) -> list[str]:
    """Freeze the MTP weights: ``requires_grad=False`` on every MTP-only parameter.

    MTP-only parameters are ``mtp.*`` plus the embedding copy on an MTP pipeline stage without
    ``pre_process``. The weights stay in ``state_dict`` and checkpoints, bit-identical across
    optimizer steps. Call it before wrapping the model in DDP, so the MTP parameters never enter
    the gradient buckets.

    Returns:
        The frozen parameter names.

    Raises:
        UnsupportedModelError: The model is already wrapped in DDP.
    """
    capabilities, _, _ = _adapters()
    from . import _freezing

    models, wrappers = capabilities.unwrap(model)
    frozen: list[str] = _freezing.freeze_mtp_parameters(models, wrappers)
    return frozen


def freeze_trunk(model: Any) -> list[str]:
    """Freeze everything but MTP: ``requires_grad=False`` on every parameter that is not
    MTP-only, for training the MTP heads alone (the mirror of :func:`freeze_mtp`).

    The trunk, the embedding and the output layer stay bit-identical across optimizer steps
    while the MTP layers train on their inputs; the trunk's MoE routers get
    ``frozen_expert_bias``. Call it before wrapping the model in DDP.

    Returns:
        The frozen parameter names.

    Raises:
        UnsupportedModelError: The model is already wrapped in DDP, has no MTP block, or has
            trunk MoE routers whose expert bias this megatron-core cannot hold still.
    """
    capabilities, _, _ = _adapters()
    from . import _freezing

    models, wrappers = capabilities.unwrap(model)
    frozen: list[str] = _freezing.freeze_trunk_parameters(models, wrappers)
    return frozen


def clip_mtp_apart(model: Any) -> list[str]:
    """Have megatron's optimizer clip the MTP weights' gradient norm apart from the trunk's.

    Tags every parameter of the MTP block with megatron's MTP gradient-norm group, exactly as
    megatron tags them when a model is built with ``mtp_detach_heads=True``. Its optimizer then
    leaves MTP's gradients out of the trunk's norm and clips them by a norm of their own, so a
    ``+detach`` training step updates the trunk bit for bit as a skipped one does. Without it, a
    global clip counts MTP's gradients in the trunk's clip coefficient. ``+detach`` is refused on
    a model whose MTP weights are not tagged.

    Call it on the bare model before wrapping it in DDP and building the optimizer. On a
    pipeline stage without MTP it tags nothing. Idempotent.

    Returns:
        The tagged parameter names.

    Raises:
        UnsupportedModelError: The model is already wrapped in DDP, an MTP parameter already
            belongs to another group, or this megatron-core's optimizer has no separate groups
            (before 0.19). Nothing is changed.

    Example:
        .. code-block:: python

            model = GPTModel(config, spec, vocab, seq, mtp_block_spec=mtp)
            mtp_hooks.megatron.clip_mtp_apart(model)
            ddp = DistributedDataParallel(config, ddp_config, model)
            optimizer = get_megatron_optimizer(OptimizerConfig(clip_grad=1.0, ...), [ddp])
            mtp_hooks.attach(ddp)
            mtp_hooks.configure("train=run:0.3+detach,eval=skip")
    """
    capabilities, _, _ = _adapters()
    from . import _freezing

    models, wrappers = capabilities.unwrap(model)
    tagged: list[str] = _freezing.clip_mtp_apart_parameters(models, wrappers)
    return tagged

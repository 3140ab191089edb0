"""Megatron-Core adapters: gate the MTP block of ``GPTModel`` and ``HybridModel`` per forward call.

Importing this subpackage imports neither torch nor megatron-core; they are imported when a
model is attached.
"""

from __future__ import annotations

from ._attach import attach, clip_mtp_apart, freeze_mtp, freeze_trunk, remove
from ._call_extensions import CallExtension, Extensions, PlannedCall
from ._handle import AttachHandle

__all__ = [
    "AttachHandle",
    "CallExtension",
    "Extensions",
    "PlannedCall",
    "attach",
    "auto_attach",
    "clip_mtp_apart",
    "freeze_mtp",
    "freeze_trunk",
    "remove",
]


def auto_attach(enabled: bool = True, *, clip_mtp_apart: bool = False) -> None:
    """Attach every MTP-carrying megatron-core model built from now on in this process.

    A model is attached at its first forward, through the outermost wrapper (DDP,
    Float16Module) built around it by then, so the DDP remedies apply; a wrapper built later
    re-attaches it. It works through torch's module *registration* hook, which runs while
    modules are built and never at forward time; models without MTP get no hook at all.
    Idempotent. ``auto_attach(False)`` stops watching for new models; models already attached
    stay attached (``mtp_hooks.remove`` them). ``MTP_HOOKS_AUTO=1`` turns it on in every Python
    process that sees the variable, at the moment that process imports torch.

    Args:
        enabled: Start (``True``, the default) or stop watching for new models.
        clip_mtp_apart: Also tag each model's MTP weights for megatron's separate MTP
            gradient clip (:func:`clip_mtp_apart`) the moment its MTP block is built, before
            any wrapper or optimizer exists (default ``False``). ``+detach`` under megatron's
            clipping optimizer needs the tag, and where a framework builds the model, the
            optimizer and the first forward in one call (Megatron-LM's ``pretrain()``,
            ``train_rl.py``), there is no other moment to set it. Needs megatron-core 0.19+.

    Example:
        .. code-block:: python

            mtp_hooks.auto_attach()
            model = GPTModel(config, spec, vocab, seq, mtp_block_spec=mtp)
            loss = model(ids, pos, mask, labels=labels)  # attached; the policy applies
    """
    try:
        from ._auto import enable
    except ImportError as exc:
        from .._errors import UnsupportedModelError

        raise UnsupportedModelError(
            f"mtp_hooks.auto_attach needs torch ({exc}); pip install 'mtp-hooks[megatron]'"
        ) from exc
    enable(enabled, clip_mtp_apart=clip_mtp_apart)

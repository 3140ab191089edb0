"""A layout whose MTP has a pipeline stage of its own (``config.mtp_standalone``).

megatron-core places the MTP layers on a stage before the last (a pipeline layout such as
``[["embedding", "decoder", "decoder", "mtp"], ["loss"]]``). That stage runs the MTP block and
sends its output on: the trunk's hidden states followed by one block of hidden states per MTP
depth, concatenated along the sequence. The last stage, which has the output layer and no MTP
block, splits what it receives into ``1 + mtp_num_layers`` parts when ``config.mtp_num_layers``
is set, and computes the language-model loss and each depth's MTP loss. megatron sends the
shapes ahead of the tensors in such a layout (``p2p_communication``, ``mtp_standalone``), so
a stage may send fewer rows without any exchange hanging.

So the MTP stage's gate decides as every gate does, and a skip there sends the trunk's hidden
states alone; the loss stage's gate does not decide run or skip on its own: it reads how many
rows arrived for this microbatch and follows what the MTP stage did (a skip there gives it the
config view with ``mtp_num_layers=None``). Each microbatch is thus handled alike on both stages
by construction, with no collective; the loss weight and ``+detach`` come from the loss stage's
own decision, which the rank-consistent policy makes equal to the MTP stage's.
"""

from __future__ import annotations

from typing import Any

from .._errors import UnsupportedModelError


def layout(config: Any) -> bool:
    """Whether ``config`` describes a layout whose MTP has a pipeline stage of its own."""
    return bool(getattr(config, "mtp_standalone", False))


def loss_stage(model: Any) -> bool:
    """Whether ``model`` is the stage that computes the losses of such a layout: it has the
    output layer and ``mtp_num_layers``, no MTP block, and computes the MTP losses from the
    depths the MTP stage sends along."""
    config = getattr(model, "config", None)
    return (
        layout(config)
        and bool(getattr(config, "mtp_num_layers", None))
        and bool(getattr(model, "post_process", False))
        and not getattr(model, "mtp_process", False)
    )


def mtp_ran(
    model: Any, args: tuple[Any, ...], kwargs: dict[str, Any], labels_at: int | None
) -> bool:
    """Whether the MTP stage ran MTP for the microbatch now in ``model`` (a loss stage), from the
    rows of the hidden states it sent (``model.decoder.input_tensor``) against the tokens'.

    Raises:
        UnsupportedModelError: No received hidden states or tokens to compare, or a row count
            that is neither the trunk's nor the trunk's with every depth.
    """
    hidden = getattr(getattr(model, "decoder", None), "input_tensor", None)
    tokens = kwargs.get("labels")
    if tokens is None and labels_at is not None and labels_at < len(args):
        tokens = args[labels_at]
    if tokens is None:
        tokens = args[0] if args else kwargs.get("input_ids")
    if hidden is None or tokens is None:
        raise UnsupportedModelError(
            "mtp_hooks: the loss stage of a standalone-MTP layout was called without the hidden "
            "states of the previous stage (model.set_input_tensor) or without labels, so it "
            "cannot tell whether the MTP stage ran MTP for this microbatch. Call it as "
            "megatron's pipeline schedules do."
        )
    rows = tokens.shape[-1]  # [batch, sequence]: this rank's part of the sequence (CP)
    config = model.config
    if getattr(config, "sequence_parallel", False):
        rows //= model.tp_group.size()
    depths = config.mtp_num_layers
    if hidden.shape[0] == rows * (1 + depths):
        return True
    if hidden.shape[0] == rows:
        return False
    raise UnsupportedModelError(
        f"mtp_hooks: the loss stage of a standalone-MTP layout received {hidden.shape[0]} rows "
        f"of hidden states for {rows} token positions, neither the trunk's ({rows}) nor the "
        f"trunk's with {depths} MTP depth(s) ({rows * (1 + depths)}), so it cannot follow the "
        "MTP stage's decision. Check that both stages use the same model config."
    )

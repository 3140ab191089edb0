"""A plain megatron-core training and validation loop that knows nothing of mtp-hooks.

Run as a script by tests/zero_edit. It builds a tiny GPTModel with one MTP layer, wraps it in
torch DDP, trains a few steps and validates a few batches the way Megatron-LM's ``evaluate()``
does (``eval()`` + ``no_grad``, with labels), and prints, as JSON, how often ``model.mtp`` ran
in each. Any MTP policy comes from the environment alone.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for the CPU stand-ins

from cpu_stand_ins import install_cpu_memory_buffer  # noqa: E402

STEPS, SEQ, VOCAB = 3, 16, 128


def main() -> None:
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    from megatron.core.transformer.transformer_config import TransformerConfig

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    install_cpu_memory_buffer()
    for key in ("values", "loss_values", "correct_values", "total_values"):
        MTPLossLoggingHelper.tracker[key] = torch.zeros(1)

    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        mtp_num_layers=1,
        mtp_loss_scaling_factor=0.1,
        use_cpu_initialization=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    spec = get_gpt_layer_local_spec()
    torch.manual_seed(0)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="learned_absolute",
        mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False),
    )
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    counts = {"train": 0, "eval": 0}
    phase = ["train"]
    model.mtp.register_forward_hook(lambda *a: counts.__setitem__(phase[0], counts[phase[0]] + 1))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    pos = torch.arange(SEQ).unsqueeze(0).expand(2, -1)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    labels = torch.roll(ids, -1, dims=1)
    for _ in range(STEPS):
        ddp.train()
        optimizer.zero_grad()
        ddp(ids, pos, mask, labels=labels).mean().backward()
        optimizer.step()
    tracker = MTPLossLoggingHelper.tracker  # "values" up to megatron-core 0.16, then "loss_values"
    mtp_loss = sum(float(tracker[key].sum()) for key in ("values", "loss_values"))
    phase[0] = "eval"
    ddp.eval()
    with torch.no_grad():
        for _ in range(STEPS):
            ddp(ids, pos, mask, labels=labels)
    print(json.dumps({"mtp_forwards": counts, "train_mtp_loss": mtp_loss}))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

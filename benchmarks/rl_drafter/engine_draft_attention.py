"""What megatron's inference engine feeds an MTP depth's attention when it drafts.

megatron-core's engine drafts through ``compute_mtp_single_step`` (0.17 to 0.19, and
Megatron-LM main as of 2026-08): the verified token of every active request goes in as one
sequence of ``[requests, 1, hidden]``, with no attention mask, no rotary embedding and no KV
cache. The MTP layer's self-attention is causal, so request ``r``'s draft attends over requests
``0..r`` of the batch and never over its own earlier positions. This script shows it on the
model megatron builds with Transformer Engine's layers on a GPU (a CPU test shows it with
megatron's local layers): each request's draft logits batched against alone, and after
changing only request 0.

    python benchmarks/rl_drafter/engine_draft_attention.py [--requests 8]
"""

from __future__ import annotations

import argparse
import json


def compare(model, requests: int) -> dict:
    """Each request's draft logits (megatron's ``compute_mtp_single_step``, first depth)
    batched as the engine batches them against each request alone, and after changing only
    request 0's hidden state."""
    import torch

    device = next(model.parameters()).device
    h = model.config.hidden_size
    hidden = torch.randn(requests, 1, h, device=device, dtype=model.config.params_dtype)
    tokens = torch.randint(0, model.vocab_size, (1, requests), device=device)
    positions = torch.arange(requests, device=device).unsqueeze(0) + 5

    def draft(hid: torch.Tensor, tok: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        # The engine hands over tensors made under inference mode; Transformer Engine's norm
        # refuses a normal tensor viewed inside the method's own inference mode.
        with torch.inference_mode():
            _, logits = model.compute_mtp_single_step(
                hidden_states=hid.clone(),
                next_token_ids=tok.clone(),
                position_ids=where.clone(),
                depth=0,
            )
            return logits.float()

    batched = draft(hidden, tokens, positions)
    alone = torch.cat(
        [
            draft(hidden[r : r + 1], tokens[:, r : r + 1], positions[:, r : r + 1])
            for r in range(requests)
        ]
    )
    changed = hidden.clone()
    changed[0] = torch.randn(1, h, device=device, dtype=hidden.dtype)
    after = draft(changed, tokens, positions)
    return {
        "requests": requests,
        "batched_vs_alone_max_abs": [
            float((batched[r] - alone[r]).abs().max()) for r in range(requests)
        ],
        "after_changing_request_0_max_abs": [
            float((after[r] - batched[r]).abs().max()) for r in range(requests)
        ],
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=8)
    args = p.parse_args(argv)

    import torch

    from mtp_hooks.demo import tiny_models

    if not torch.cuda.is_available():
        raise SystemExit(
            "engine_draft_attention.py builds Transformer Engine's layers and needs a GPU; on "
            "a CPU, tests/adapters/test_engine_draft_attention.py shows the same with "
            "megatron's local layers"
        )
    from megatron.core import tensor_parallel

    tiny_models.init_single_process()
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)
    spec = tiny_models.TinySpec(mtp_num_layers=1)
    model = tiny_models.build_gpt(spec, transformer_impl="transformer_engine").cuda().eval()
    result = {"layers": "transformer_engine", **compare(model, args.requests)}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()

"""What megatron's inference engine feeds an MTP depth's attention when it drafts.

megatron-core's engine drafts through ``compute_mtp_single_step`` (0.19 and Megatron-LM main
as of 2026-08): the verified token of every active request goes in as one sequence of
``[requests, 1, hidden]``, with no attention mask, no rotary embedding and no KV cache. The
MTP layer's self-attention is causal, so request ``r``'s draft attends over requests
``0..r`` of the batch and never over its own earlier positions. This script shows it on the
model megatron builds (Transformer Engine's layers on a GPU, megatron's local layers on a
CPU): each request's draft logits batched against alone, and after changing only request 0.

    python benchmarks/rl_drafter/engine_draft_attention.py [--requests 8]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=8)
    args = p.parse_args(argv)

    import torch

    from mtp_hooks.demo import tiny_models

    cuda = torch.cuda.is_available()
    tiny_models.init_single_process()
    if not cuda:  # megatron's local attention allocates its scratch and causal mask on CUDA
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
        import cpu_stand_ins

        cpu_stand_ins.install_cpu_memory_buffer()
        cpu_stand_ins.build_causal_masks_on_cpu()
    else:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)
    spec = tiny_models.TinySpec(mtp_num_layers=1)
    impl = "transformer_engine" if cuda else "local"
    model = tiny_models.build_gpt(spec, transformer_impl=impl).eval()
    device = "cuda" if cuda else "cpu"
    model = model.to(device)
    n, h = args.requests, model.config.hidden_size
    hidden = torch.randn(n, 1, h, device=device, dtype=model.config.params_dtype)
    tokens = torch.randint(0, spec.vocab_size, (1, n), device=device)
    positions = torch.arange(n, device=device).unsqueeze(0) + 5

    @torch.no_grad()
    def draft(hid: torch.Tensor, tok: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        _, logits = model.compute_mtp_single_step(
            hidden_states=hid, next_token_ids=tok, position_ids=where, depth=0
        )
        return logits.float()

    batched = draft(hidden, tokens, positions)
    alone = torch.cat(
        [draft(hidden[r : r + 1], tokens[:, r : r + 1], positions[:, r : r + 1]) for r in range(n)]
    )
    changed = hidden.clone()
    changed[0] = torch.randn(1, h, device=device, dtype=hidden.dtype)
    after = draft(changed, tokens, positions)
    result = {
        "layers": impl,
        "requests": n,
        "batched_vs_alone_max_abs": [float((batched[r] - alone[r]).abs().max()) for r in range(n)],
        "after_changing_request_0_max_abs": [
            float((after[r] - batched[r]).abs().max()) for r in range(n)
        ],
        "top1_batched_equals_alone": [
            bool(batched[r].argmax() == alone[r].argmax()) for r in range(n)
        ],
    }
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()

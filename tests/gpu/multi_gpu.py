"""Multi-GPU checks, run with ``torchrun --nproc-per-node 2 tests/gpu/multi_gpu.py``.

Not collected by pytest (it needs several GPUs and torchrun); docs/distributed.md records its
output. On two GPUs it runs, with NCCL:

1. DP=2: the Megatron DDP training of tests/gpu/test_megatron_ddp.py (overlapped grad reduce,
   distributed optimizer, overlapped param gather) with MTP run, skipped, skipped in the last
   microbatch only, and frozen; then verify mode with a rank-dependent plugin.
2. TP=2: a tensor-parallel GPTModel with an agreeing policy (run, then skip), then verify mode
   with a rank-dependent plugin.

Each rank prints one ``RESULT`` line per check.
"""

from __future__ import annotations

import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "gpu")]
os.environ["MTP_HOOKS_DISABLE_PLUGIN_AUTOLOAD"] = "1"

import torch  # noqa: E402

import mtp_hooks  # noqa: E402
from mtp_hooks.demo import tiny_models  # noqa: E402


class RankDependent:
    @mtp_hooks.plugins.hookimpl
    def should_run_mtp(self, model, phase):
        return torch.distributed.get_rank() == 0


def report(check: str, outcome: str) -> None:
    print(f"RESULT rank={torch.distributed.get_rank()} {check}: {outcome}", flush=True)


def mismatch(model, *args, **kwargs) -> str:
    mtp_hooks.testing.reset()
    mtp_hooks.attach(model, verify=True)
    mtp_hooks.plugins.register(RankDependent(), name="rank-dependent")
    try:
        model(*args, **kwargs)
    except mtp_hooks.DecisionMismatchError as exc:
        return f"DecisionMismatchError: {exc}"
    finally:
        mtp_hooks.remove(model)
    return "no error (WRONG)"


def check_data_parallel() -> None:
    import test_megatron_ddp as t

    for mode in ("run", "skip", "skip_last", "frozen"):
        mtp_hooks.testing.reset()
        tiny_models.reset_mtp_loss_tracker(device="cuda")
        losses, before, after = t.train(mode)
        finite = all(math.isfinite(x) for x in losses)
        frozen = all(torch.equal(before[n], after[n]) for n in before)
        report(
            f"dp2 {mode}",
            f"losses={[round(x, 4) for x in losses]} finite={finite} mtp_unchanged={frozen}",
        )
    spec = tiny_models.TinySpec(
        hidden_size=256, num_layers=2, num_attention_heads=8, vocab_size=1024, seq_length=128
    )
    model = tiny_models.build_gpt(spec, attention="local").cuda()
    ids = torch.randint(0, 1024, (2, 128), device="cuda")
    pos = torch.arange(128, device="cuda").unsqueeze(0).expand(2, -1)
    report("dp2 verify rank-dependent", mismatch(model, ids, pos, None, labels=ids))


def check_tensor_parallel() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    tiny_models.reset_mtp_loss_tracker(device="cuda")
    spec = tiny_models.TinySpec(
        hidden_size=256,
        num_layers=2,
        num_attention_heads=8,
        vocab_size=1024,
        seq_length=128,
        extra={"tensor_model_parallel_size": 2},
    )
    torch.manual_seed(0)
    model = tiny_models.build_gpt(spec, attention="local").cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, 1024, (2, 128), device="cuda", generator=g)
    pos = torch.arange(128, device="cuda").unsqueeze(0).expand(2, -1)
    mtp_hooks.testing.reset()
    handle = mtp_hooks.attach(model, verify=True)
    mtp_hooks.configure("train=run,rollout=skip")
    run_loss = model(ids, pos, None, labels=ids)
    run_loss.sum().backward()
    recorded = tiny_models.recorded_mtp_loss()
    tiny_models.reset_mtp_loss_tracker(device="cuda")
    with mtp_hooks.phase("rollout"):
        skip_loss = model(ids, pos, None, labels=ids)
        skip_loss.sum().backward()
    report(
        "tp2 agreeing",
        f"stats={handle.stats()} mtp_loss_after_run={recorded > 0} "
        f"mtp_loss_after_skip={tiny_models.recorded_mtp_loss() > 0} "
        f"lm_loss_equal={bool(torch.equal(run_loss, skip_loss))}",
    )
    handle.remove()
    report("tp2 verify rank-dependent", mismatch(model, ids, pos, None, labels=ids))


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    torch.distributed.init_process_group("nccl")
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel()
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    check_data_parallel()
    check_tensor_parallel()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

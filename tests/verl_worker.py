"""veRL 0.9.1's own actor worker in one CPU process: ``python tests/verl_worker.py ARGS``.

Runs ``ActorRolloutRefWorker(role="actor")`` as a veRL Ray worker runs it (``init_model``, then
``compute_log_prob`` and ``update_actor`` per step), without Ray or a rollout engine (role
``actor`` builds none), and prints one JSON line of observables. veRL's files run unedited.
What stands in, here and nowhere else:

* **the model source**: veRL builds its model from a Hugging Face checkpoint through a bridge;
  here the engine's two build steps make a tiny megatron-core model in the process instead,
  still through veRL's own ``check_mtp_config`` and its DDP wrapping (``get_model``);
* **what a CPU lacks**: a ``cpu`` platform in veRL's platform registry, veRL's own engine
  override (``VERL_ENGINE_DEVICE``), the gloo group started first, and megatron's direct CUDA
  calls pointed at the CPU.

The plugin is on unless ``--no-plugin`` (then ``MTP_HOOKS_AUTO=0`` and the veRL plugin is
disabled, as on a machine without mtp-hooks-verl).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Shape:
    """The model's sizes and one step's rollouts: prompts left-padded to ``prompt`` tokens,
    responses right-padded to ``response`` (every other rollout shorter, so that packing and
    padding both matter), ``micro`` rollouts per micro-batch."""

    vocab: int
    rollouts: int
    prompt: int
    response: int
    micro: int
    large: bool = False

    @property
    def seq(self) -> int:
        return self.prompt + self.response

    def lengths(self, i: int) -> tuple[int, int]:
        """Rollout ``i``'s (prompt, response) lengths."""
        short = i % 2
        return self.prompt - short, self.response - 2 * short


SHAPES = {
    "tiny": Shape(vocab=128, rollouts=2, prompt=4, response=6, micro=2),
    # Nemotron 3's vocabulary and layer kinds at 1.38B parameters (docs/benchmarks.md's large)
    "large": Shape(vocab=131072, rollouts=8, prompt=512, response=1536, micro=4, large=True),
}


# -- the model source ---------------------------------------------------------------------------
def build_model(
    args: argparse.Namespace, depths: int | None, pre_process: bool, post_process: bool
) -> Any:
    """The megatron-core model of ``args.model`` with ``depths`` MTP layers (``None``: none)."""
    import torch

    from mtp_hooks.demo import nemotron_models, tiny_models

    shape = SHAPES[args.size]
    torch.manual_seed(0)
    common: dict[str, Any] = {"pre_process": pre_process, "post_process": post_process}
    common.update(attention="sdpa", bf16=True, params_dtype=torch.bfloat16)  # veRL's dtype
    if args.model == "gpt":  # no position embedding: veRL's packed forwards pass no positions
        spec = tiny_models.TinySpec(
            seq_length=shape.seq, vocab_size=shape.vocab, mtp_num_layers=depths
        )
        return tiny_models.build_gpt(
            spec, position_embedding="none", with_mtp_block=bool(depths), **common
        )
    if args.model == "hybrid":
        spec = tiny_models.TinySpec(seq_length=shape.seq, vocab_size=shape.vocab)
        return tiny_models.build_hybrid(spec, pattern="*-" + "/*-" * (depths or 0), **common)
    if shape.large:
        spec = tiny_models.TinySpec(
            hidden_size=2048, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=2048,
            vocab_size=shape.vocab, seq_length=shape.seq, swiglu=True, rmsnorm=True, bias=False,
        )  # fmt: skip
        trunk, sizes = "M*MEMEM*MEME", {"num_experts": 8, "moe_ffn_hidden_size": 2048}
    else:
        spec = tiny_models.TinySpec(
            hidden_size=32, num_attention_heads=2, seq_length=shape.seq, vocab_size=shape.vocab,
            rmsnorm=True, bias=False,
        )  # fmt: skip
        trunk, sizes = "M*E", {}
    return nemotron_models.build_nemotron(
        spec,
        pattern=trunk + "/*E" * (depths or 0),
        expert_bias=torch.cuda.is_available(),  # megatron allocates the bias on CUDA
        **sizes,
        **common,
    )


def replace_model_source(args: argparse.Namespace) -> None:
    """The engine's two build steps (HF checkpoint -> bridge -> model -> weights), replaced by
    a model built here, through veRL's own ``check_mtp_config`` and DDP wrapping."""
    import torch
    from verl.utils.megatron_utils import _get_mtp_num_layers, check_mtp_config, get_model
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    def build_tf_config(engine: Any) -> None:
        engine.is_value_model = False
        engine.share_embeddings_and_output_weights = False
        check_mtp_config(engine.model_config, engine.engine_config)  # veRL's own MTP decision
        engine.param_dtype = engine.dtype = torch.bfloat16
        engine.provider = engine.bridge = engine.peft_cls = None
        engine.vanilla_bridge = False
        engine.tf_config = None  # set from the model built below

    def build_megatron_module(engine: Any) -> list[Any]:
        depths = _get_mtp_num_layers(engine.model_config.hf_config) or None

        def provider(pre_process: bool, post_process: bool, vp_stage: int | None = None) -> Any:
            return build_model(args, depths, pre_process, post_process)

        module = get_model(
            provider,
            wrap_with_ddp=not engine.engine_config.forward_only,
            use_distributed_optimizer=engine.engine_config.use_distributed_optimizer,
        )
        engine.tf_config = module[0].config
        return module

    MegatronEngine._build_tf_config = build_tf_config
    MegatronEngine._build_megatron_module = build_megatron_module


def model_directory(root: Path, shape: Shape) -> Path:
    """What veRL reads from a checkpoint directory besides weights: a Hugging Face config (its
    ``num_nextn_predict_layers`` is what ``check_mtp_config`` reads) and a tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    path = root / "model"
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(128)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="t0", eos_token="t1")
    fast.save_pretrained(path)
    LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=shape.seq,
        num_nextn_predict_layers=1,
        architectures=["LlamaForCausalLM"],
        tie_word_embeddings=False,
    ).save_pretrained(path)
    return path


def trainer_config(
    args: argparse.Namespace, shape: Shape, model_path: Path, checkpoint: Path
) -> Any:
    """veRL's composed default trainer config, with this run's model, batch and MTP config."""
    from importlib.resources import files

    from omegaconf import OmegaConf

    default = files("verl.trainer.config") / "_generated_ppo_megatron_trainer.yaml"
    config = OmegaConf.load(str(default))
    mtp: dict[str, dict[str, bool]] = {"off": {}, "load": {"enable": True}}
    mtp["train"] = {"enable": True, "enable_train": True}
    mtp["detach"] = {**mtp["train"], "detach_encoder": True}
    settings: dict[str, Any] = {
        "model.path": str(model_path),
        "model.use_remove_padding": args.format == "thd",
        **{f"model.mtp.{key}": value for key, value in mtp[args.mtp].items()},
        # no bridge: the model source stands in, and the checkpoint manager then asks for
        # megatron's dist checkpoints
        "actor.megatron.use_dist_checkpointing": True,
        "actor.megatron.dist_checkpointing_path": str(checkpoint),
        "actor.ppo_mini_batch_size": shape.rollouts,
        "actor.ppo_micro_batch_size_per_gpu": shape.micro,
        "actor.optim.total_training_steps": 10,  # the trainer sets it from the data
        "rollout.log_prob_micro_batch_size_per_gpu": shape.micro,
        "rollout.n": 1,
    }
    for key, value in settings.items():
        OmegaConf.update(config, f"actor_rollout_ref.{key}", value)
    return config


# -- the batches, as veRL's trainer hands them over ----------------------------------------------
def rollout_batch(shape: Shape) -> Any:
    import torch
    from verl import DataProto

    g = torch.Generator().manual_seed(11)
    ids = torch.randint(2, shape.vocab, (shape.rollouts, shape.seq), generator=g)
    mask = torch.zeros(shape.rollouts, shape.seq, dtype=torch.int64)
    for i in range(shape.rollouts):
        prompt, response = shape.lengths(i)
        mask[i, shape.prompt - prompt : shape.prompt + response] = 1
    ids = ids * mask  # padding is token 0
    position_ids = (torch.cumsum(mask, dim=1) - 1).clamp(min=0)
    return DataProto.from_single_dict(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": position_ids,
            "prompts": ids[:, : shape.prompt],
            "responses": ids[:, shape.prompt :],
            "response_mask": mask[:, shape.prompt :],
        },
        meta_info={"temperature": 1.0, "global_token_num": mask.sum(-1).tolist()},
    )


def log_prob_batch(shape: Shape) -> Any:
    """As the trainer's ``_compute_old_log_prob`` hands it over."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    batch = left_right_2_no_padding(rollout_batch(shape).to_tensordict())
    tu.assign_non_tensor(batch, calculate_entropy=True, compute_loss=False)
    return batch


def update_batch(shape: Shape, old_log_probs: Any) -> Any:
    """As the trainer's ``_update_actor`` hands it over (one mini-batch, one epoch)."""
    import torch
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    data = rollout_batch(shape)
    unpadded = left_right_2_no_padding(rollout_batch(shape).to_tensordict())
    data.batch["old_log_probs"] = no_padding_2_padding(old_log_probs, unpadded).float()
    advantages = torch.linspace(-1, 1, shape.response).expand(shape.rollouts, -1)
    data.batch["advantages"] = advantages.clone()
    data.meta_info["multi_turn"] = False
    batch = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(
        batch,
        calculate_entropy=False,
        distillation_use_topk=False,
        distillation_only=False,
        global_batch_size=shape.rollouts,
        mini_batch_size=shape.rollouts,
        epochs=1,
        seed=1,
        dataloader_kwargs={"shuffle": False},
        compute_loss=True,
    )
    return batch


# -- the observables ----------------------------------------------------------------------------
class Observed:
    """MTP forwards per veRL call, and which parameters received gradients in the update."""

    def __init__(self, model: Any) -> None:
        self.runs: dict[str, int] = {}
        self.call = ""
        self.grads: set[str] = set()
        self.watching = True
        mtp = getattr(model, "mtp", None)
        if mtp is not None:
            mtp.register_forward_hook(lambda *a: self.count())
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.register_hook(lambda g, name=name: self.saw(name, g))

    def saw(self, name: str, grad: Any) -> Any:
        # a skipped forward owes megatron's DDP a gradient for every MTP parameter (zeros)
        if self.watching and bool(grad.ne(0).any()):
            self.grads.add(name)
        return grad

    def count(self) -> None:
        self.runs[self.call] = self.runs.get(self.call, 0) + 1

    def start(self, call: str) -> None:
        self.call = call
        self.runs[call] = 0
        self.grads.clear()

    def trained(self) -> dict[str, bool]:
        return {
            "mtp": any(n.startswith("mtp.") for n in self.grads),
            "trunk": any(not n.startswith("mtp.") for n in self.grads),
        }


def _plain(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return float(value) if hasattr(value, "__float__") else str(value)


def timed(call: Any) -> tuple[Any, float, float]:
    """``call()``'s result, its wall seconds and, on a GPU, its peak allocated GiB."""
    import time

    import torch

    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    result = call()
    if gpu:
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30 if gpu else 0.0
    return result, time.perf_counter() - start, peak


def drive(args: argparse.Namespace) -> dict[str, Any]:
    import hashlib

    from verl.utils.megatron_utils import unwrap_model
    from verl.workers.engine_workers import ActorRolloutRefWorker

    shape = SHAPES[args.size]
    root = Path(tempfile.mkdtemp(prefix="verl-worker-"))
    config = trainer_config(args, shape, model_directory(root, shape), root / "checkpoint")
    worker = ActorRolloutRefWorker(config=config.actor_rollout_ref, role="actor")
    _, init_s, _ = timed(worker.init_model)
    model = unwrap_model(worker.actor.engine.module[0])  # inside DDP and Float16Module
    seen = Observed(model)
    steps = []
    for step in range(args.steps):
        seen.watching = step == 0  # gradients are read in the first step only (host syncs)
        seen.start("compute_log_prob")
        output, log_prob_s, log_prob_peak = timed(
            lambda: worker.compute_log_prob(log_prob_batch(shape))
        )
        log_probs = output["log_probs"]
        log_prob_trained = seen.trained()
        seen.start("update_actor")
        output, update_s, update_peak = timed(
            lambda old=log_probs: worker.update_actor(update_batch(shape, old))
        )
        values = log_probs.values().float().cpu()
        steps.append(
            {
                "mtp_forwards": dict(seen.runs),
                "gradients": {"compute_log_prob": log_prob_trained, "update_actor": seen.trained()}
                if step == 0
                else None,
                "log_probs": [float(x) for x in values] if not shape.large else None,
                "log_probs_sha256": hashlib.sha256(values.numpy().tobytes()).hexdigest(),
                "metrics": {k: _plain(v) for k, v in sorted(output["metrics"].items())},
                "seconds": {"compute_log_prob": log_prob_s, "update_actor": update_s},
                "peak_gib": {"compute_log_prob": log_prob_peak, "update_actor": update_peak},
            }
        )
    parameters = sum(p.numel() for p in model.parameters())
    return {
        "model": type(model).__name__,
        "parameters": parameters,
        "has_mtp": hasattr(model, "mtp"),
        "init_seconds": init_s,
        "steps": steps,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import contextlib

    import pytest
    import torch

    from mamba_on_cpu import expose_mamba_triton_kernels, kernel_launches_on_cpu
    from verl_on_cpu import (
        cuda_on_the_cpu,
        point_megatron_at_the_cpu,
        register_cpu_platform,
        start_gloo,
    )

    expose_mamba_triton_kernels()  # before megatron is imported: it decides HAVE_MAMBA_SSM then
    if torch.cuda.is_available():  # veRL as it runs on a GPU, nothing else standing in
        replace_model_source(args)
        return drive(args)
    os.environ.update(
        VERL_PLATFORM="cpu",
        # veRL's engine registry has CUDA and NPU keys only; its own override picks the engine
        VERL_ENGINE_DEVICE="cuda",
        VERL_ENGINE_VENDOR="nvidia",
    )
    register_cpu_platform()
    start_gloo()
    point_megatron_at_the_cpu()  # before veRL's engine imports what it replaces
    replace_model_source(args)
    with contextlib.ExitStack() as stack:
        if args.model == "nemotron":
            import megatron.core.ssm.mamba_mixer  # noqa: F401  (its kernels, to point at the CPU)

            patch = stack.enter_context(pytest.MonkeyPatch.context())
            stack.enter_context(kernel_launches_on_cpu(patch))
        stack.enter_context(cuda_on_the_cpu())
        return drive(args)


def run_in_a_process(
    model: str, mtp: str, data_format: str, plugin: bool, size: str = "tiny", steps: int = 1
) -> dict[str, Any]:
    """This script run for one configuration, in a process of its own (veRL's worker owns the
    process: its groups, megatron's parallel state), without the caller's MTP_HOOKS_*
    settings; its JSON result. Raises AssertionError with the end of stderr if it fails."""
    import subprocess

    from ports import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("MTP_HOOKS_")}
    command = [sys.executable, __file__, "--model", model, "--mtp", mtp]
    command += ["--format", data_format, "--size", size, "--steps", str(steps)]
    command += ["--port", str(free_port())] + ([] if plugin else ["--no-plugin"])
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["gpt", "hybrid", "nemotron"], required=True)
    parser.add_argument("--mtp", choices=["off", "load", "train", "detach"], required=True)
    parser.add_argument("--format", choices=["thd", "bshd"], default="thd")
    parser.add_argument("--size", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--no-plugin", action="store_true")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--steps", type=int, default=1)
    return parser.parse_args()


def main() -> None:
    args = parse()
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port),
    )  # fmt: skip
    if args.no_plugin:
        os.environ.update(MTP_HOOKS_AUTO="0", MTP_HOOKS_DISABLE="verl")
    sys.path.insert(0, str(HERE))
    print(json.dumps(run(args)))


if __name__ == "__main__":
    main()

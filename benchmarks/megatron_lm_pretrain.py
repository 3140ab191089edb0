"""Megatron-LM's own ``pretrain()`` on a tiny GPT with one MTP layer; mtp-hooks is nowhere here.

The policy comes from the environment alone (``MTP_HOOKS_AUTO=1 MTP_HOOKS_POLICY=...``); this
driver only counts, with a forward hook of its own on ``model.mtp``, how often MTP ran in
training and in ``evaluate()``, and prints that as JSON at exit. It mirrors the structure of
Megatron-LM's ``pretrain_gpt.py`` (not shipped in the megatron-core wheel) with mock data and
the ``NullTokenizer``. Run on one GPU::

    torchrun --nproc-per-node 1 benchmarks/megatron_lm_pretrain.py --mock-data \\
        --tokenizer-type NullTokenizer --vocab-size 1024 --transformer-impl local ...

``benchmarks/megatron_lm_pretrain.sh`` runs it three ways (no switch, ``eval=skip``,
``train=skip``) with the full flag set.
"""

from __future__ import annotations

import atexit
import json
from functools import partial

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.training import get_args, pretrain
from megatron.training.argument_utils import (
    gpt_config_from_args,
    pretrain_cfg_container_from_args,
)
from megatron.training.arguments import parse_and_validate_args

MTP_FORWARDS = {"train": 0, "eval": 0}
_hooked: list[torch.nn.Module] = []


def _count(module: torch.nn.Module, args: tuple, output: object) -> None:
    MTP_FORWARDS["train" if module.training and torch.is_grad_enabled() else "eval"] += 1


def _watch_mtp(model: torch.nn.Module) -> None:
    inner = model
    while not hasattr(inner, "mtp") and hasattr(inner, "module"):
        inner = inner.module
    if inner not in _hooked and hasattr(inner, "mtp"):
        inner.mtp.register_forward_hook(_count)
        _hooked.append(inner)


def loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
    losses, mask = output.view(-1).float(), loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    tokens = mask.sum().to(torch.int)
    return loss, tokens, {"lm loss": torch.cat([loss.detach().view(1), tokens.view(1)])}


def forward_step(data_iterator, model: torch.nn.Module, return_schedule_plan: bool = False):
    _watch_mtp(model)
    batch = {
        k: v.cuda(non_blocking=True) if torch.is_tensor(v) else v
        for k, v in next(data_iterator).items()
    }
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch.get("attention_mask"),
        labels=batch["labels"],
        loss_mask=batch["loss_mask"],
    )
    return output, partial(loss_func, batch["loss_mask"])


def datasets_provider(num_samples, vp_stage=None):
    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None,
        blend_per_split=None,
        split="98,2,0",
        path_to_cache=None,
        tokenizer=build_tokenizer(args),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        mid_level_dataset_surplus=0.005,
    )
    return BlendedMegatronDatasetBuilder(MockGPTDataset, num_samples, lambda: True, config).build()


datasets_provider.is_distributed = True  # type: ignore[attr-defined]


def main() -> None:
    atexit.register(lambda: print("MTP_FORWARDS " + json.dumps(MTP_FORWARDS), flush=True))
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    pretrain(config, datasets_provider, ModelType.encoder_or_decoder, forward_step)


if __name__ == "__main__":
    main()

"""The RL drafter benchmark's model and training: a GPTModel with two MTP layers built from
megatron's own layer specs, fp32 master weights under AdamW with trunk and MTP clipped apart,
and one timed training step under phase ``train``."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

DEPTH = 2  # MTP layers, and the most tokens the engine drafts


def build_model(args):
    import torch

    from mtp_hooks.demo import tiny_models

    cuda = args.device == "cuda"
    spec = tiny_models.TinySpec(
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_attention_heads=args.heads,
        ffn_hidden_size=4 * args.hidden,
        vocab_size=args.vocab,
        seq_length=max(args.seq, args.prompt_len + args.gen + DEPTH + 1),
        mtp_num_layers=DEPTH,
        swiglu=True,
        rmsnorm=True,
        bias=False,
        params_dtype=torch.bfloat16 if cuda else torch.float32,
        extra={"mtp_loss_scaling_factor": args.mtp_scale},
    )
    torch.manual_seed(args.seed)
    model = tiny_models.build_gpt(spec, attention="local" if cuda else "sdpa")
    return model.to(args.device)


@dataclass
class Trainer:
    """fp32 master weights and AdamW over a (bf16) megatron model; trunk and MTP weights are
    clipped apart, each by its own gradient norm."""

    model: object
    lr: float
    clip: float
    params: list = field(default_factory=list)
    master: list = field(default_factory=list)
    is_mtp: list = field(default_factory=list)
    optimizer: object = None

    def __post_init__(self) -> None:
        import torch

        mtp = {id(p) for p in self.model.mtp.parameters()}
        self.params = list(self.model.parameters())
        self.is_mtp = [id(p) in mtp for p in self.params]
        self.master = [torch.nn.Parameter(p.detach().float().clone()) for p in self.params]
        self.optimizer = torch.optim.AdamW(
            self.master, lr=self.lr, betas=(0.9, 0.95), weight_decay=0.01
        )

    def step(self) -> None:
        import torch

        for m, p in zip(self.master, self.params, strict=True):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        for mtp in (False, True):
            group = [
                m
                for m, t in zip(self.master, self.is_mtp, strict=True)
                if t is mtp and m.grad is not None
            ]
            if group and self.clip > 0:
                torch.nn.utils.clip_grad_norm_(group, self.clip)
        self.optimizer.step()
        with torch.no_grad():
            for m, p in zip(self.master, self.params, strict=True):
                p.copy_(m)
        for m in self.master:
            m.grad = None

    def trunk(self) -> list:
        """The fp32 master copies of the trunk's weights (embedding and output layer included)."""
        return [m.detach() for m, t in zip(self.master, self.is_mtp, strict=True) if not t]

    def state(self) -> dict:
        return copy.deepcopy({"master": self.master, "opt": self.optimizer.state_dict()})

    def load(self, state: dict) -> None:
        import torch

        with torch.no_grad():
            for m, s, p in zip(self.master, state["master"], self.params, strict=True):
                m.copy_(s)
                p.copy_(s)
        self.optimizer.load_state_dict(copy.deepcopy(state["opt"]))


def train_step(model, trainer: Trainer, ids, device: str, batch=None) -> float:
    """One training step under phase ``train``; returns its wall time in ms.

    Without ``batch`` every position but the last counts, for the policy's loss and MTP's
    alike, through the ``loss_mask`` handed to the model. With an :class:`RLBatch` the policy's
    loss counts its response; the model gets no ``loss_mask``, and MTP's loss is masked to the
    response when ``batch.mtp_response_only`` is set.
    """
    import contextlib

    import torch

    import mtp_hooks

    ids = (ids if batch is None else batch.ids).to(device)
    pos = torch.arange(ids.shape[1], device=device).unsqueeze(0).expand_as(ids)
    labels = torch.roll(ids, -1, dims=1)
    if batch is None:
        mask = torch.ones_like(ids, dtype=torch.float32)
        mask[:, -1] = 0
        kwargs, block = {"loss_mask": mask}, contextlib.nullcontext()
    else:
        mask, kwargs = batch.response.to(device), {}
        block = (
            mtp_hooks.mtp_loss_mask(mask) if batch.mtp_response_only else contextlib.nullcontext()
        )
    sync(device)
    start = time.perf_counter()
    with mtp_hooks.phase("train"), block:
        loss = model(ids, pos, None, labels=labels, **kwargs)
        (loss.float() * mask).sum().div(mask.sum()).backward()
    trainer.step()
    sync(device)
    return (time.perf_counter() - start) * 1e3


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()

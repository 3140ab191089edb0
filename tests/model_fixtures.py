"""Fixtures for real megatron-core models on a CPU, and the test-only stand-ins they need.

A pytest plugin of tests/conftest.py (``pytest_plugins``) where megatron-core is installed;
tests/adapters and tests/plugins turn the zeroed MTP loss tracker on for each of their tests.

megatron's local ``DotProductAttention`` takes a scratch buffer that its ``GlobalMemoryBuffer``
allocates on CUDA; :class:`CPUMemoryBuffer` allocates the same buffer on the CPU. The MTP loss
tracker gets CPU tensors before each test (``tiny_models.reset_mtp_loss_tracker``). These
stand-ins live here, in the test harness, and nowhere in the library.
"""

from __future__ import annotations

import copy
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

import mtp_hooks  # noqa: E402
from mtp_hooks.demo import tiny_models  # noqa: E402

from cpu_stand_ins import install_cpu_memory_buffer  # noqa: E402
from mamba_on_cpu import kernel_launches_on_cpu, mamba_runs_here  # noqa: E402
from ports import free_port  # noqa: E402

__all__ = [
    "megatron_cpu",
    "mtp_tracker",
    "batch",
    "kind",
    "build",
    "count_mtp",
    "Batch",
    "SEQ",
    "native",
    "Wrapper",
    "Held",
    "Paused",
    "forward_in",
    "train_step",
    "deepcopy_model",
    "VOCAB",
]

SEQ, BATCH, VOCAB = 16, 2, 128


def nemotron_spec() -> tiny_models.TinySpec:
    """The sizes of the CPU tests' Nemotron-3-shaped hybrid: as small as megatron allows, since
    its Mamba-2 layers run mamba-ssm's Triton kernels through Triton's interpreter."""
    return tiny_models.TinySpec(
        hidden_size=32,
        num_attention_heads=2,
        seq_length=SEQ,
        vocab_size=VOCAB,
        rmsnorm=True,
        bias=False,
    )


def has_hybrid() -> bool:
    try:
        import megatron.core.models.hybrid.hybrid_model  # noqa: F401
    except ImportError:
        return False
    return True


def has_detach_field() -> bool:
    """Whether this megatron-core has ``mtp_detach_heads`` (0.19 on), which ``+detach`` needs."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return "mtp_detach_heads" in TransformerConfig.__dataclass_fields__


def has_transformer_engine() -> bool:
    """Whether a CUDA GPU and ``transformer_engine`` are both there (the TE tests need both)."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def guards_empty_masks() -> bool:
    """Whether megatron's MTP loss survives a mask with no position (process_mtp_loss, 0.18 on);
    mtp-hooks refuses MTP loss masks where it does not (0.16)."""
    from megatron.core.transformer import multi_token_prediction

    return hasattr(multi_token_prediction, "process_mtp_loss")


@pytest.fixture(scope="session")
def megatron_cpu():
    """One gloo rank with megatron's parallel state, and a CPU scratch buffer for attention."""
    tiny_models.init_single_process(port=free_port())
    install_cpu_memory_buffer()
    yield


@pytest.fixture
def mamba_cpu(megatron_cpu, monkeypatch):
    """Megatron's Mamba-2 layers and MoE routers on this machine: on a CPU, mamba-ssm's Triton
    kernels through Triton's interpreter (tests/mamba_on_cpu.py says what stands in)."""
    if not mamba_runs_here():
        pytest.skip("megatron's Mamba-2 layer needs megatron-core 0.18+ and mamba-ssm")
    if torch.cuda.is_available():
        yield
        return
    with kernel_launches_on_cpu(monkeypatch):
        yield


@pytest.fixture
def mtp_tracker(megatron_cpu):
    """A zeroed MTP loss tracker on the CPU before every test."""
    tiny_models.reset_mtp_loss_tracker()


@dataclass
class Batch:
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    labels: torch.Tensor

    def args(self) -> tuple:
        return (self.input_ids, self.position_ids, self.attention_mask)


@pytest.fixture
def batch() -> Batch:
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    mask = torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool)).logical_not()[None, None]
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return Batch(ids, pos, mask.expand(BATCH, 1, SEQ, SEQ), labels)


@dataclass
class PackedRow:
    """Two sequences packed into one row (THD), the first with a masked-out prompt: the
    packed-sequence arguments, ids, positions (restarting per sequence), loss mask and the
    sequence boundaries."""

    packed: object
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    cuts: list[int]

    def kwargs(self) -> dict:
        """The forward's keyword arguments: packed sequences, the next tokens, the mask."""
        labels = torch.roll(self.input_ids, -1, 1)
        return {"packed_seq_params": self.packed, "labels": labels, "loss_mask": self.loss_mask}


def packed_row(vocab: int = 128) -> PackedRow:
    from megatron.core.packed_seq_params import PackedSeqParams

    cuts = [0, 7, SEQ]
    cu = torch.tensor(cuts, dtype=torch.int32)
    packed = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=9, max_seqlen_kv=9
    )
    ids = torch.randint(0, vocab, (1, SEQ), generator=torch.Generator().manual_seed(15))
    pos = torch.cat([torch.arange(7), torch.arange(SEQ - 7)]).unsqueeze(0)
    mask = torch.ones(1, SEQ)
    mask[0, 2:5] = 0  # the first sequence's prompt
    return PackedRow(packed, ids, pos, mask, cuts)


KINDS = [
    "gpt",
    pytest.param(
        "hybrid",
        marks=pytest.mark.skipif(
            not has_hybrid(), reason="HybridModel needs megatron-core 0.18+ (models/hybrid)"
        ),
    ),
]


@pytest.fixture(params=KINDS)
def kind(request) -> str:
    """Each adapter test runs on a GPTModel and on a HybridModel."""
    return request.param


@pytest.fixture
def build(kind) -> Callable[..., torch.nn.Module]:
    """``build(seed=0, **kw)``: a fresh model of the current kind with one MTP layer."""

    def make(seed: int = 0, **kwargs) -> torch.nn.Module:
        torch.manual_seed(seed)
        spec = kwargs.pop("spec", tiny_models.TinySpec(seq_length=SEQ, vocab_size=VOCAB))
        builder = tiny_models.build_gpt if kind == "gpt" else tiny_models.build_hybrid
        return builder(spec, **kwargs)

    return make


@pytest.fixture
def count_mtp() -> Callable[[torch.nn.Module], tiny_models.MTPForwards]:
    """``count_mtp(model).n``: how many times ``model.mtp`` ran."""
    return tiny_models.MTPForwards


@functools.cache  # one class per base (ModelOpt registers dynamic classes by name)
def native(kind: str) -> type:
    """A model class whose forward takes Megatron-LM main's ``compute_mtp_loss`` keyword.

    ``compute_mtp_loss=False`` skips the MTP block and its loss for the call, as on main
    (emulated on a released class by hiding ``mtp_process`` inside forward). Each call's
    ``(flag, mtp_process, config)`` as the model received them is appended to ``received``.
    """
    if kind == "gpt":
        from megatron.core.models.gpt import GPTModel as Base
    else:
        from megatron.core.models.hybrid.hybrid_model import HybridModel as Base

    class NativeFlagModel(Base):
        def forward(self, *args, compute_mtp_loss: bool = True, **kwargs):
            self.__dict__.setdefault("received", []).append(
                (compute_mtp_loss, self.mtp_process, self.config)
            )
            if compute_mtp_loss:
                return super().forward(*args, **kwargs)
            saved = self.mtp_process
            object.__setattr__(self, "mtp_process", False)
            try:
                return super().forward(*args, **kwargs)
            finally:
                object.__setattr__(self, "mtp_process", saved)

    NativeFlagModel.__name__ = NativeFlagModel.__qualname__ = f"NativeFlag{Base.__name__}"
    return NativeFlagModel


class Wrapper(torch.nn.Module):
    """Like Float16Module or Megatron DDP: the real model sits at ``.module``."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


THREAD_TIMEOUT = 60


class Held:
    """Runs ``model``'s forward in ``phase`` in a thread and holds it where ``place`` puts the
    hold (``place(hold)`` registers it as some hook and returns the hook's handle), until
    released: the hold waits in that thread alone."""

    def __init__(self, model, batch, phase: str, place: Callable[[Callable], object]):
        self.reached, self.release = threading.Event(), threading.Event()
        self.error: BaseException | None = None

        def hold(*_):
            if threading.current_thread() is self.thread:
                self.holding()
                self.reached.set()
                assert self.release.wait(THREAD_TIMEOUT)
                self.holding()

        self.hook = place(hold)

        def run():
            try:
                model.eval()
                with torch.no_grad(), mtp_hooks.phase(phase):
                    model(*batch.args(), labels=batch.labels)
            except BaseException as exc:  # reported to the test
                self.error = exc

        self.thread = threading.Thread(target=run)
        self.thread.start()
        assert self.reached.wait(THREAD_TIMEOUT)

    def holding(self) -> None:
        """Called in the held thread as the hold begins and as it ends."""

    def finish(self) -> None:
        self.release.set()
        self.thread.join(THREAD_TIMEOUT)
        self.hook.remove()
        if self.error is not None:
            raise self.error


class Paused(Held):
    """Holds ``model``'s forward inside the decoder; ``seen``: the gates (``mtp_process``, and
    whether ``config`` is the model's own) as the hold began and as it ended."""

    def __init__(self, model, batch, phase: str):
        self.model, self.shared = model, model.config
        self.seen: list[tuple[bool, bool]] = []
        super().__init__(model, batch, phase, model.decoder.register_forward_hook)

    def holding(self) -> None:
        self.seen.append((self.model.mtp_process, self.model.config is self.shared))


def megatron_ddp_steps(
    model: torch.nn.Module,
    batch,
    steps: int,
    optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] = lambda params: (
        torch.optim.SGD(params, lr=0.1)
    ),
) -> None:
    """``steps`` training steps as a megatron loop runs them: ``model`` wrapped in megatron's
    ``DistributedDataParallel`` and attached through it, ``finalize_model_grads``, then the
    optimizer on the trainable parameters' gathered gradients."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    ddp = DistributedDataParallel(
        config=model.config, ddp_config=DistributedDataParallelConfig(), module=model
    )
    mtp_hooks.attach(ddp)
    params = [p for p in model.parameters() if p.requires_grad]
    step = optimizer(params)
    ddp.train()
    for _ in range(steps):
        ddp.zero_grad_buffer()
        ddp(*batch.args(), labels=batch.labels).sum().backward()
        finalize_model_grads([ddp])
        for p in params:
            p.grad = p.main_grad
        step.step()


def train_step(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    """One training forward and backward: the loss and a copy of every parameter's gradient
    (``None`` where it has none), so that a later step cannot change what a test compares."""
    model.zero_grad(set_to_none=True)
    model.train()
    loss = model(*batch.args(), labels=batch.labels)
    loss.sum().backward()
    return loss.detach(), {
        n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()
    }


def measured_eval(model, batch, labels=None, loss_mask=None) -> mtp_hooks.AttachHandle:
    """Attach ``model`` under ``eval=run+metrics`` and run one evaluation forward of ``batch``
    (with ``labels``, the batch's own by default, and ``loss_mask``); returns the handle, whose
    metrics hold that forward."""
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("eval=run+metrics")
    model.eval()
    with torch.no_grad():
        model(*batch.args(), labels=batch.labels if labels is None else labels, loss_mask=loss_mask)
    return handle


def forward_in(model, batch, phase: str) -> None:
    with torch.no_grad(), mtp_hooks.phase(phase):
        model(*batch.args(), labels=batch.labels)


def deepcopy_model(model: torch.nn.Module) -> torch.nn.Module:
    """``copy.deepcopy`` with megatron's process groups shared: they cannot be copied."""
    groups: dict[int, object] = {}

    def collect(value: object, depth: int = 0) -> None:
        if isinstance(value, torch.distributed.ProcessGroup):
            groups[id(value)] = value
        elif isinstance(value, (list, tuple)):
            for item in value:
                collect(item, depth + 1)
        elif depth < 2 and type(value).__name__ == "ProcessGroupCollection":
            for item in vars(value).values():
                collect(item, depth + 1)

    for module in model.modules():
        for value in vars(module).values():
            collect(value)
    return copy.deepcopy(model, groups)


def observe(model, batch, phase: str) -> tuple[bool, bool]:
    """One forward as the frameworks run it in ``phase``; returns (MTP ran, MTP loss recorded).

    ``train``: a training forward with labels and backward (the actor/policy update).
    ``rollout``: a log-prob forward, ``eval()`` + ``no_grad``, no labels, phase ``rollout``.
    ``eval``: a validation forward, ``eval()`` + ``no_grad``, with labels.
    """
    ran = tiny_models.MTPForwards(model)
    tiny_models.reset_mtp_loss_tracker()
    try:
        if phase == "train":
            model.train()
            model(*batch.args(), labels=batch.labels).sum().backward()
        elif phase == "rollout":
            model.eval()
            with torch.no_grad(), mtp_hooks.phase("rollout"):
                model(*batch.args())
        else:
            model.eval()
            with torch.no_grad():
                model(*batch.args(), labels=batch.labels)
    finally:
        ran.remove()
    return ran.n > 0, tiny_models.recorded_mtp_loss() > 0

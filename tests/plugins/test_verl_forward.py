"""veRL 0.9.1's own forward of a Megatron model, unedited, with mtp-hooks-verl's worker default.

``gptmodel_forward_model_engine`` (``verl/models/mcore/model_forward.py``) is what veRL's
Megatron engine calls for every micro-batch of ``compute_log_prob`` (under ``eval()`` and
``no_grad``) and of ``update_actor`` (``train()``); its logits go through the engine's own
``_lm_head_logits_processor``. Both run here as veRL's files have them (checked by hash), on a
``GPTModel``, an attention-only ``HybridModel`` and a Nemotron-3-shaped ``HybridModel``, in
packed (THD) and padded (BSHD) batches, for each of veRL's MTP configs:

* ``off``: ``enable=False``; veRL builds no MTP block (``check_mtp_config``).
* ``load``: ``enable`` without ``enable_train``: MTP must never run.
* ``train`` and ``detach``: ``enable_train`` (with ``detach_encoder``): MTP trains in the
  update only.

veRL applies its ``mtp_patch`` to a ``GPTModel`` when ``enable`` is on, as its engine does
(``patch_engine_mtp``). The worker default is unconfigured, as in a Ray worker: it reads
veRL's intent from the call (labels or a loss mask are passed only when MTP trains).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib.resources import files
from types import SimpleNamespace

import pytest
import torch

import mtp_hooks
from mtp_hooks.demo import nemotron_models, tiny_models

from model_fixtures import has_hybrid, nemotron_spec

pytest.importorskip("verl")
pytest.importorskip("tensordict")
from verl.models.mcore.model_forward import gptmodel_forward_model_engine  # noqa: E402
from verl.utils.megatron_utils import patch_engine_mtp  # noqa: E402
from verl.workers.config import MtpConfig  # noqa: E402
from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead  # noqa: E402

# The veRL 0.9.1 files these tests and tests/plugins/test_verl_worker.py run, by sha256: a new
# veRL fails here first, so that the findings in docs/integrations.md (with their file:line)
# are read again before it is trusted.
VERL_FILES = {
    "models/mcore/model_forward.py": (
        "1e0f9d6acc4916eee59a45c31511882117b5ae7c2a5da4333462a5aede80aae7"
    ),
    "models/mcore/mtp_patch.py": "ec40e5b11b5ae4620f32639d04738ee6e9ffa670dc5c4c196b16767de0cde68a",
    "models/mcore/util.py": "37ae7f377679a6a769c77758e620c1b364aafd4d3d4873279f9afffa038c0362",
    "workers/engine/megatron/transformer_impl.py": (
        "02e59909dfb33b109e38dece65021b2445aafe2ec1031624481c2b5600fddfb7"
    ),
    "utils/megatron_utils.py": "4d2f479cb10ebcaf98235b1b4afbd8104c0a30654f7bff290768453421e58a3f",
    # what tests/verl_worker.py runs besides: the worker, its engine base, the padding helpers,
    # the default config, and the platform registry the CPU platform is registered in
    "workers/engine_workers.py": "ff9a0ebd003e52a4c6d9c14d853df8d624dd6f5f514b456ca0ccc09510e31265",
    "workers/engine/base.py": "c3d0f88e32f8fe044bf7c4d249dfc4cfcee66ccc89b9850d971798b1b20f6a92",
    "workers/utils/padding.py": "4e29a4af7d6f7a2182cbd45536df5c3423745e925d0cd3bb151440dbfba8fbcc",
    "trainer/config/_generated_ppo_megatron_trainer.yaml": (
        "1be20fcd7e94d74daa6b8031c9f61876f28711228f0d27d1fc5b4ac103c62dcc"
    ),
    "plugin/platform/platform_base.py": (
        "ca9e43fef5966fb14e30d24d8f645d81d79719ba76e73408259655ea07d9553b"
    ),
    "plugin/platform/platform_manager.py": (
        "9791896de6917a76f218f5db780ea2208a9c3dd2adfae2aee1589573911dc956"
    ),
}

CONFIGS = {
    "off": MtpConfig(enable=False),
    "load": MtpConfig(enable=True, enable_train=False),
    "train": MtpConfig(enable=True, enable_train=True),
    "detach": MtpConfig(enable=True, enable_train=True, detach_encoder=True),
}
LENGTHS = (7, 11)  # two responses of different lengths: packing and padding both matter
PROMPT = 3  # the first tokens of each sequence are the prompt


def test_veRLs_files_are_the_ones_these_tests_were_written_against():
    root = files("verl")
    found = {path: hashlib.sha256((root / path).read_bytes()).hexdigest() for path in VERL_FILES}
    assert found == VERL_FILES


@dataclass
class Rollout:
    """One micro-batch as veRL's engine hands it to the forward: jagged tensors per sequence."""

    input_ids: torch.Tensor
    label: torch.Tensor
    loss_mask: torch.Tensor
    temperature: torch.Tensor

    @staticmethod
    def make(vocab: int) -> Rollout:
        g = torch.Generator().manual_seed(7)
        ids = [torch.randint(0, vocab, (n,), generator=g) for n in LENGTHS]
        masks = [torch.arange(n) >= PROMPT for n in LENGTHS]
        jagged = lambda ts: torch.nested.nested_tensor(ts, layout=torch.jagged)  # noqa: E731
        return Rollout(
            input_ids=jagged(ids),
            label=jagged([torch.roll(t, -1) for t in ids]),
            loss_mask=jagged(masks),
            temperature=jagged([torch.ones(n) for n in LENGTHS]),
        )


def lm_head(logits, label, temperature, *, data_format):
    """The engine's own logits processor (self is read only for entropy, which is off)."""
    return MegatronEngineWithLMHead._lm_head_logits_processor(
        None,
        logits,
        label,
        temperature,
        calculate_sum_pi_squared=False,
        calculate_entropy=False,
        distillation_use_topk=False,
        distillation_only=False,
        logits_processor_func=None,
        batch=None,
        data_format=data_format,
    )


def verl_forward(model, rollout: Rollout, config: MtpConfig, data_format: str) -> torch.Tensor:
    """One call of veRL's forward as its engine makes it; the log-probs, packed per token."""
    from functools import partial

    output = gptmodel_forward_model_engine(
        model,
        rollout.input_ids,
        {},
        logits_processor=partial(lm_head, data_format=data_format),
        logits_processor_args={
            "label": rollout.label,
            "temperature": rollout.temperature,
            "loss_mask": rollout.loss_mask,
            "response_attention_mask": None,
        },
        data_format=data_format,
        mtp_enable_train=config.enable and config.enable_train,
    )
    return output["log_probs"].values()


def build(kind: str, config: MtpConfig, seed: int = 0) -> torch.nn.Module:
    """The model veRL's engine would build for ``config``, with veRL's patch where it applies."""
    torch.manual_seed(seed)
    depths = None if not config.enable else 1
    if kind == "gpt":  # no position embedding: veRL's packed forwards pass no position_ids
        spec = tiny_models.TinySpec(seq_length=16, vocab_size=128, mtp_num_layers=depths)
        model = tiny_models.build_gpt(
            spec, attention="sdpa", position_embedding="none", with_mtp_block=config.enable
        )
    elif kind == "hybrid":
        spec = tiny_models.TinySpec(seq_length=16, vocab_size=128)
        pattern = "*-/*-" if depths else "*-"
        model = tiny_models.build_hybrid(spec, attention="sdpa", pattern=pattern)
    else:
        pattern = "M*E/*E" if depths else "M*E"
        model = nemotron_models.build_nemotron(
            nemotron_spec(), attention="sdpa", pattern=pattern, expert_bias=False
        )
    if config.enable:
        patch_engine_mtp(model, SimpleNamespace(mtp=config))  # GPTModel only; HybridModel: a note
    return model


@dataclass
class Steps:
    """What one compute_log_prob and one update_actor forward did."""

    log_prob_mtp: int
    update_mtp: int
    log_probs: torch.Tensor
    mtp_grads: list[str]
    trunk_grads: dict[str, torch.Tensor]


def run_steps(kind: str, config: MtpConfig, data_format: str, plugin: bool) -> Steps:
    model = build(kind, config)
    if plugin:
        mtp_hooks.attach(model)
    runs = tiny_models.MTPForwards(model) if config.enable else SimpleNamespace(n=0)
    rollout = Rollout.make(vocab=128)
    model.eval()
    with torch.no_grad():  # compute_log_prob
        log_probs = verl_forward(model, rollout, config, data_format)
    log_prob_mtp = runs.n
    model.train()  # update_actor: a stand-in policy loss on veRL's log-probs
    verl_forward(model, rollout, config, data_format).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return Steps(
        log_prob_mtp=log_prob_mtp,
        update_mtp=runs.n - log_prob_mtp,
        log_probs=log_probs,
        mtp_grads=sorted(n for n in grads if n.startswith("mtp.")),
        trunk_grads={n: g for n, g in grads.items() if not n.startswith("mtp.")},
    )


PACKED_MAMBA = (
    "megatron's Mamba-2 layer takes packed sequences only on its memory-efficient path, which "
    "needs causal-conv1d (CUDA): Nemotron THD runs on a GPU (tests/gpu/test_verl_on_gpu.py)"
)

# (MTP forwards in compute_log_prob, in update_actor), without the plugin and with it
EXPECTED = {
    ("gpt", "off"): ((0, 0), (0, 0)),
    ("gpt", "load"): ((0, 0), (0, 0)),  # veRL's patch: MTP runs only when labels are passed
    ("gpt", "train"): ((1, 1), (0, 1)),
    ("gpt", "detach"): ((1, 1), (0, 1)),
    ("hybrid", "off"): ((0, 0), (0, 0)),
    ("hybrid", "load"): ((1, 1), (0, 0)),  # unpatched, megatron runs MTP in every forward
    ("nemotron", "off"): ((0, 0), (0, 0)),
    ("nemotron", "load"): ((1, 1), (0, 0)),
}
KINDS = ["gpt", "hybrid", "nemotron"]


@pytest.fixture
def veRL_worker(kind, megatron_cpu, request, only):
    if kind != "gpt" and not has_hybrid():
        pytest.skip("HybridModel needs megatron-core 0.18+")
    if kind == "nemotron":
        request.getfixturevalue("mamba_cpu")
    tiny_models.reset_mtp_loss_tracker()
    only("verl")  # unconfigured: the worker default, as in a Ray worker that imported verl


@pytest.mark.parametrize("data_format", ["thd", "bshd"])
@pytest.mark.parametrize("config", ["off", "load", "train", "detach"])
@pytest.mark.parametrize("kind", KINDS)
def test_each_verl_mtp_config_runs_mtp_only_where_verl_asks(kind, config, data_format, veRL_worker):
    if kind != "gpt" and config in ("train", "detach"):
        pytest.skip("veRL 0.9.1 cannot train a HybridModel's MTP (the next test)")
    if kind == "nemotron" and data_format == "thd" and not torch.cuda.is_available():
        pytest.skip(PACKED_MAMBA)
    without = run_steps(kind, CONFIGS[config], data_format, plugin=False)
    with_plugin = run_steps(kind, CONFIGS[config], data_format, plugin=True)
    expected_without, expected_with = EXPECTED[(kind, config)]
    assert (without.log_prob_mtp, without.update_mtp) == expected_without
    assert (with_plugin.log_prob_mtp, with_plugin.update_mtp) == expected_with
    # compute_log_prob gives the same bits: MTP never touches the main logits
    assert torch.equal(without.log_probs, with_plugin.log_probs)
    # MTP's weights train exactly where it runs in the update
    assert bool(with_plugin.mtp_grads) == (with_plugin.update_mtp > 0)
    if expected_without[1] == expected_with[1]:  # the same update: the same gradients
        assert without.mtp_grads == with_plugin.mtp_grads
        assert without.trunk_grads.keys() == with_plugin.trunk_grads.keys()
        for name, grad in without.trunk_grads.items():
            assert torch.equal(grad, with_plugin.trunk_grads[name]), name


@pytest.mark.parametrize("kind", ["hybrid", "nemotron"])
def test_veRL_0_9_1_cannot_train_a_hybrid_models_mtp_with_or_without_the_plugin(kind, veRL_worker):
    # veRL passes labels to a HybridModel, which then returns the language-model loss where
    # veRL's logits processor expects logits: dividing the loss by the temperature fails
    # (transformer_impl.py:1209). If this test fails, veRL has changed: the veRL section of
    # docs/integrations.md says what to read again.
    data_format = "bshd" if kind == "nemotron" and not torch.cuda.is_available() else "thd"
    for plugin in (False, True):
        with pytest.raises(RuntimeError) as info:
            run_steps(kind, CONFIGS["train"], data_format, plugin=plugin)
        where = info.traceback[-1]  # pytest counts lines from 0
        assert (where.path.name, where.lineno + 1) == ("transformer_impl.py", 1209)

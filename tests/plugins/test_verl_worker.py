"""veRL 0.9.1's own actor worker (``ActorRolloutRefWorker(role="actor")``), driven through
``init_model``, ``compute_log_prob`` and ``update_actor`` in a process of its own
(tests/verl_worker.py says what stands in on a CPU), with mtp-hooks-verl and without it.

Each case runs one step of a hand-built two-rollout batch both ways and compares what veRL
itself reports (log-probs, ``pg_loss``, ``grad_norm``, its ``mtp_losses`` metric) with what the
model did: MTP forwards per veRL call, and whether MTP's weights got a non-zero gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from model_fixtures import has_hybrid
from verl_worker import run_in_a_process

pytest.importorskip("verl")
pytest.importorskip("hydra")

MTP_LOSS = "mtp_losses/mtp_1_loss"  # veRL's own metric of the MTP loss


@dataclass(frozen=True)
class Case:
    model: str
    mtp: str
    data_format: str
    without: tuple[int, int]
    """MTP forwards in (compute_log_prob, update_actor) without the plugin."""
    with_plugin: tuple[int, int]
    """The same with mtp-hooks-verl."""

    @property
    def id(self) -> str:
        return f"{self.model}-{self.mtp}-{self.data_format}"


CASES = [
    Case("gpt", "off", "thd", (0, 0), (0, 0)),
    # veRL's own patch runs GPT's MTP only where it passes labels: never, without enable_train
    Case("gpt", "load", "thd", (0, 0), (0, 0)),
    Case("gpt", "train", "thd", (1, 1), (0, 1)),
    Case("gpt", "train", "bshd", (1, 1), (0, 1)),
    Case("gpt", "detach", "thd", (1, 1), (0, 1)),
    Case("hybrid", "off", "thd", (0, 0), (0, 0)),
    # unpatched, megatron runs and trains a HybridModel's MTP in every forward
    Case("hybrid", "load", "thd", (1, 1), (0, 0)),
    Case("hybrid", "load", "bshd", (1, 1), (0, 0)),
    # Nemotron-3-shaped (Mamba-2, MoE, attention): padded batches only on a CPU, since
    # megatron's Mamba-2 layer takes packed ones only with causal-conv1d (CUDA)
    Case("nemotron", "load", "bshd", (1, 1), (0, 0)),
]


def run_worker(case: Case, plugin: bool) -> dict:
    (step,) = run_in_a_process(case.model, case.mtp, case.data_format, plugin)["steps"]
    return step


def calls(step: dict) -> tuple[int, int]:
    forwards = step["mtp_forwards"]
    return forwards["compute_log_prob"], forwards["update_actor"]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_veRLs_worker_runs_mtp_only_where_its_config_asks(case):
    if case.model != "gpt" and not has_hybrid():
        pytest.skip("HybridModel needs megatron-core 0.18+")
    without, hooked = run_worker(case, plugin=False), run_worker(case, plugin=True)
    assert calls(without) == case.without
    assert calls(hooked) == case.with_plugin
    # compute_log_prob: the same log-probs, no gradients either way
    assert hooked["log_probs"] == without["log_probs"]
    assert not any(hooked["gradients"]["compute_log_prob"].values())
    # update_actor: the trunk trains; MTP's weights exactly where MTP ran
    update = hooked["gradients"]["update_actor"]
    assert update == {"mtp": case.with_plugin[1] > 0, "trunk": True}
    assert without["gradients"]["update_actor"]["mtp"] == (case.without[1] > 0)
    # veRL's own metrics: the policy loss never changes; its MTP loss is reported exactly
    # where MTP ran in the update; the rest is unchanged where the update is the same
    assert hooked["metrics"]["actor/pg_loss"] == without["metrics"]["actor/pg_loss"]
    assert (MTP_LOSS in hooked["metrics"]) == (case.with_plugin[1] > 0)
    if case.without[1] == case.with_plugin[1]:
        for name in ("grad_norm", MTP_LOSS):
            assert hooked["metrics"].get(name) == without["metrics"].get(name), name


@pytest.mark.parametrize("model", ["hybrid", "nemotron"])
def test_veRL_0_9_1_cannot_train_a_hybrid_models_mtp_in_its_worker(model):
    # veRL passes labels to a HybridModel, which then returns its loss where veRL's logits
    # processor expects logits (verl/workers/engine/megatron/transformer_impl.py:1209);
    # tests/plugins/test_verl_forward.py pins the line
    if not has_hybrid():
        pytest.skip("HybridModel needs megatron-core 0.18+")
    case = Case(model, "train", "bshd" if model == "nemotron" else "thd", (0, 0), (0, 0))
    for plugin in (False, True):
        with pytest.raises(AssertionError, match="doesn't match the broadcast shape|must match"):
            run_worker(case, plugin)

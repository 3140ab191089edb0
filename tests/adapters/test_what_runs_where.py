"""The contributors' guide decides which tests run on which megatron-core from what each release
can do (docs/contributing.md, "What runs where"). Its table of capabilities is checked here
against the probes the library itself uses, on every megatron-core of the matrix: a new pin
that changes a probe fails this test, and the matrix has to be decided again."""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from mtp_hooks.megatron import _capabilities

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "contributing.md"


def _has_hybrid() -> bool:
    return any(cls.__name__ == "HybridModel" for cls in _capabilities.language_model_classes())


def _drafts_single_positions() -> bool:
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    return callable(getattr(MultiTokenPredictionLayer, "forward_single_position", None))


def _has_detach_field() -> bool:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return _capabilities.has_detach_field(object.__new__(TransformerConfig))


def _native_flag() -> bool:
    from megatron.core.models.gpt import GPTModel

    return _capabilities.native_flag(GPTModel)


PROBES: dict[str, Callable[[], bool]] = {  # the table's first column: what is probed
    "`HybridModel`": _has_hybrid,
    "`InferenceMode.is_active`": lambda: _capabilities.inference_mode_class() is not None,
    "`process_mtp_loss`": _capabilities.guards_empty_mtp_masks,
    "`forward_single_position`": _drafts_single_positions,
    "`FullCudaGraphWrapper.reset_cuda_graph`": lambda: (
        _capabilities.full_graph_wrapper() is not None
    ),
    "MTP labels from `input_ids`": _capabilities.mtp_loss_derives_labels,
    "`mtp_detach_heads`": _has_detach_field,
    "the `mtp` gradient-norm group": lambda: _capabilities.mtp_grad_norm_group() == "mtp",
    "`compute_mtp_loss`": _native_flag,
}


def capability_table() -> tuple[list[str], dict[str, list[str]]]:
    """The guide's capability table: its megatron-core columns, and each probe's row."""
    text = GUIDE.read_text()
    section = text[text.index("### What each megatron-core can do") :].split("\n#", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    columns = [cell.strip() for cell in lines[0].strip("|").split("|")][1:]
    rows = {}
    for line in lines[2:]:
        probe, *values = (cell.strip() for cell in line.strip("|").split("|"))
        rows[re.sub(r" \(.*\)$", "", probe)] = values
    return columns, rows


def test_the_guides_capability_table_is_what_this_megatron_core_probes():
    columns, rows = capability_table()
    assert set(rows) == set(PROBES), "the guide's table and this test name other probes"
    version = importlib.metadata.version("megatron-core").split("+")[0]
    if version not in columns:
        pytest.skip(f"megatron-core {version} is not in the matrix (its columns: {columns})")
    column = columns.index(version)
    found = {probe: "yes" if PROBES[probe]() else "no" for probe in PROBES}
    listed = {probe: values[column] for probe, values in rows.items()}
    assert found == listed, (
        f"megatron-core {version} probes otherwise than docs/contributing.md says: decide again "
        "which tests run on it (noxfile.py MATRIX) and correct the table"
    )

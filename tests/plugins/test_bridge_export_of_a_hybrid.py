"""What Megatron-Bridge's Hugging Face export keeps of a Nemotron-3-shaped hybrid, asked of
Bridge's own Nemotron-H parameter mappings, with mtp-hooks attached.

``megatron.bridge`` cannot be imported on a CPU machine (its package imports Transformer
Engine), so its mapping registry and parameter mappings are loaded from their files, and the
``mapping_registry`` method of its ``NemotronHBridge`` is taken from its file as written. Bridge
exports a parameter only where ``megatron_to_hf_lookup`` finds a mapping for its name, and skips
the others after a logged warning (``model_bridge.py``, checked below). The Nemotron-H bridge
maps no ``mtp.*`` name, so its export leaves the MTP block behind.
"""

from __future__ import annotations

import ast
import sys
from types import ModuleType

import pytest
import torch

import mtp_hooks
from mtp_hooks.demo import nemotron_models

from bridge_files import bridge_root, load_file
from model_fixtures import has_hybrid, nemotron_spec

pytestmark = [
    pytest.mark.skipif(not has_hybrid(), reason="HybridModel needs megatron-core 0.18+"),
    pytest.mark.usefixtures("mamba_cpu"),
]


ROOT = bridge_root()
if ROOT is None or not (ROOT / "models/nemotronh/nemotron_h_bridge.py").exists():
    pytest.skip(
        "megatron-bridge with a Nemotron-H bridge is not installed", allow_module_level=True
    )
pytest.importorskip("transformers")  # Bridge's conversion utilities import it
pytest.importorskip("rich")

CONVERSION = "megatron.bridge.models.conversion"


def load(relative: str, name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """Bridge's module at ``relative`` under its own name in ``sys.modules`` (taken out again
    by ``monkeypatch``), so that the next one's imports of it resolve."""
    module = load_file(ROOT / relative, name)
    monkeypatch.setitem(sys.modules, name, module)
    return module


@pytest.fixture
def registry(monkeypatch):
    """The registry ``NemotronHBridge.mapping_registry`` returns, from Bridge's files."""
    load("models/conversion/utils.py", f"{CONVERSION}.utils", monkeypatch)
    mappings = load(
        "models/conversion/param_mapping.py", f"{CONVERSION}.param_mapping", monkeypatch
    )
    registries = load(
        "models/conversion/mapping_registry.py", f"{CONVERSION}.mapping_registry", monkeypatch
    )
    path = ROOT / "models/nemotronh/nemotron_h_bridge.py"
    tree = ast.parse(path.read_text())
    (bridge,) = [
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "NemotronHBridge"
    ]
    (method,) = [
        n for n in bridge.body if isinstance(n, ast.FunctionDef) and n.name == "mapping_registry"
    ]
    method.decorator_list = []
    namespace = {**vars(mappings), "MegatronMappingRegistry": registries.MegatronMappingRegistry}
    exec(compile(ast.Module(body=[method], type_ignores=[]), str(path), "exec"), namespace)
    return namespace["mapping_registry"](None)


def exported_names(model: torch.nn.Module, registry) -> tuple[set[str], set[str]]:
    """The parameters Bridge's export writes and those it skips, by megatron name."""
    names = {n for n, _ in model.named_parameters()}
    kept = {n for n in names if registry.megatron_to_hf_lookup(n) is not None}
    return kept, names - kept


@pytest.mark.parametrize("repeated_mtp", [False, True], ids=["separate depths", "one shared layer"])
def test_bridge_exports_the_trunk_and_leaves_every_mtp_weight_behind(registry, repeated_mtp):
    torch.manual_seed(0)
    model = nemotron_models.build_nemotron(
        nemotron_spec(), attention="sdpa", repeated_mtp=repeated_mtp
    )
    kept, skipped = exported_names(model, registry)
    mtp = {n for n, _ in model.named_parameters() if n.startswith("mtp.")}
    assert mtp and skipped >= mtp  # every MTP weight, none exported
    assert not any(n.startswith("mtp.") for n in kept)
    assert any(".mixer.in_proj." in n for n in kept)  # the Mamba layers are exported
    assert any(".mlp.router." in n for n in kept)  # and the MoE layers
    # Bridge 0.3.1 maps Mamba's "mixer.conv1d.weight"; megatron-core 0.19 names it
    # "mixer.conv1d_weight", so those two are the only trunk weights it can leave behind
    assert all(".mixer.conv1d" in n for n in skipped - mtp), sorted(skipped - mtp)


def test_an_attached_model_offers_bridge_the_same_parameters(registry):
    torch.manual_seed(0)
    model = nemotron_models.build_nemotron(nemotron_spec(), attention="sdpa")
    before = exported_names(model, registry)
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("train=run+detach,eval=skip")
    try:
        assert exported_names(model, registry) == before
    finally:
        handle.remove()


def test_bridge_skips_a_parameter_without_a_mapping_after_a_warning():
    source = (ROOT / "models/conversion/model_bridge.py").read_text()
    assert "No mapping found for megatron_param" in source, "Bridge changed how it exports"

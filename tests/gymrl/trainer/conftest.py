"""Fixtures of the trainer tests; the real-Megatron ones (`-m megatron`) need the Megatron venv."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from gymrl.config.compose import compose_raw
from gymrl.preflight.validate import validate_config


@pytest.fixture(scope="module")
def swe_config():
    """The flagship's config (`+experiment=swe_bench_30b`)."""
    return validate_config(compose_raw(["+experiment=swe_bench_30b"]))


@pytest.fixture(scope="session")
def megatron_runtime():
    """megatron-core and Megatron-Bridge importable, on CUDA or else on the CPU through the CPU
    device shim (cpu_standins/megatron_trainer/megatron_on_cpu.py) for the rest of the session."""
    if importlib.util.find_spec("megatron.bridge") is None:
        pytest.fail(
            "megatron-core / megatron-bridge are not installed: `make megatron-venv`, then "
            ".venv-megatron/bin/python -m pytest -m megatron"
        )
    from cpu_standins.megatron_trainer import megatron_on_cpu

    megatron_on_cpu.prepare_process()
    yield "cuda" if torch.cuda.is_available() else "cpu"
    megatron_on_cpu.uninstall()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, tokenizer):
    """A generated Llama saved as a Hugging Face checkpoint: SmolLM2's tokenizer and vocabulary,
    2 layers of width 64, 4 attention heads over 2 KV heads (TP 2 splits both), random weights."""
    from gymrl.model.loading import build_tiny_llama

    folder = tmp_path_factory.mktemp("tiny_llama")
    model = build_tiny_llama(
        tokenizer,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        seed=0,
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, model

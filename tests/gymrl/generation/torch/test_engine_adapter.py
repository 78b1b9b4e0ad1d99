"""Adapter refits into the torch engine: after `update_adapter` the engine generates what the
trainer's adapter merged by PEFT into the base generates, through either decode path."""

from __future__ import annotations

import copy

import pytest
import torch

from gymrl.config.schema.loss import LossConfig
from gymrl.config.schema.trainer import LoraConfig, TorchTrainerConfig
from gymrl.generation.types import GenerationRequest, SamplingParams
from gymrl.run.adapter import AdapterWeights
from gymrl.trainer.torch_trainer import TorchPolicyTrainer
from tests.gymrl.generation.torch.test_engine import make_engine, tiny_llama

NEW_TOKENS = 6
TEXTS = ["Hello there!", "2+2=", "Write one line of Python that reverses a list."]


def _trainer(tokenizer, targets: tuple[str, ...], seed: int) -> TorchPolicyTrainer:
    """A LoRA trainer on the engine's base model whose adapter is far from zero (B drawn at
    random, as many steps of training would leave it), so that it changes greedy tokens."""
    lora = LoraConfig(enabled=True, rank=4, alpha=8, target_modules=targets)
    trainer = TorchPolicyTrainer(
        tiny_llama(tokenizer, seed=0),
        TorchTrainerConfig(lora=lora),
        LossConfig(kl_coef=0.0),
        temperature=1.0,
        pad_token_id=0,
        keep_last_checkpoints=1,
        compute_dtype="float32",
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in trainer.model.named_parameters():
            if ".lora_B." in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    return trainer


def _merged(trainer: TorchPolicyTrainer) -> torch.nn.Module:
    """The trainer's model with PEFT's own merge: the reference, not the engine's formula."""
    assert trainer._peft is not None
    return copy.deepcopy(trainer._peft).merge_and_unload().eval()


def _greedy(model, prompt: list[int]) -> list[int]:
    """Greedy tokens from full forward passes of transformers (no cache)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def _generate(engine, prompts) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)
    return [
        out.token_ids for out in engine.generate([GenerationRequest(p, params) for p in prompts])
    ]


@pytest.fixture
def prompts(tokenizer):
    return [tokenizer.encode(text) for text in TEXTS]


@pytest.mark.parametrize("decode_path", ["fused", "transformers"])
def test_after_an_adapter_refit_the_engine_generates_as_the_merged_model(
    tokenizer, prompts, decode_path
):
    engine = make_engine(tiny_llama(tokenizer, seed=0), decode_path=decode_path)
    try:
        base = _generate(engine, prompts)
        first = _trainer(tokenizer, ("q_proj", "v_proj", "gate_proj", "down_proj"), seed=1)
        engine.update_adapter(first.export_adapter(), version=1)
        expected = [_greedy(_merged(first), p) for p in prompts]
        assert _generate(engine, prompts) == expected != base
        assert engine.weight_version == 1

        # The next version replaces the first (not added to it); the modules only the first
        # adapted go back to their base weights.
        second = _trainer(tokenizer, ("o_proj", "up_proj"), seed=2)
        engine.update_adapter(second.export_adapter(), version=2)
        assert _generate(engine, prompts) == [_greedy(_merged(second), p) for p in prompts]
    finally:
        engine.close()


def test_an_adapter_for_modules_the_engine_lacks_fails_by_name_and_changes_nothing(
    tokenizer, prompts
):
    engine = make_engine(tiny_llama(tokenizer, seed=0))
    try:
        before = _generate(engine, prompts)
        adapter = _trainer(tokenizer, ("q_proj",), seed=1).export_adapter()
        renamed = {
            key.replace("self_attn.q_proj", "self_attn.qkv_proj"): tensor
            for key, tensor in adapter.tensors.items()
        }
        with pytest.raises(ValueError, match=r"qkv_proj.*not Linear modules"):
            engine.update_adapter(AdapterWeights(adapter.config, renamed), version=1)
        half = {k: v for k, v in adapter.tensors.items() if "lora_A" in k}
        with pytest.raises(ValueError, match="lack lora_A or lora_B"):
            engine.update_adapter(AdapterWeights(adapter.config, half), version=1)
        assert engine.weight_version == 0 and _generate(engine, prompts) == before
    finally:
        engine.close()

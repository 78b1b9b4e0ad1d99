"""Typed views of a Hugging Face tokenizer: its special token ids, and the text of a sequence;
and the end ids the model's own files declare.

transformers serves `eos_token_id` and the like through `__getattr__` and types `decode` for a
batch as well, so a type checker sees neither an int nor a str; these helpers give both, and a
clear error where a policy's tokenizer lacks what training needs. Torch-free, like the chat format
that uses them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import cast

from transformers import PreTrainedTokenizerBase


def single_token_id(value: object) -> int | None:
    """A named special token's id (`tokenizer.bos_token_id` and the like, typed as anything a
    token attribute may hold), or None when the tokenizer has no such token."""
    return value if isinstance(value, int) else None


def eos_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The end-of-sequence id every generation stops on; a policy's tokenizer must have one."""
    token_id = single_token_id(tokenizer.eos_token_id)
    if token_id is None:
        raise ValueError(
            f"the tokenizer {tokenizer.name_or_path!r} has no end-of-sequence token; a policy "
            "needs one to end its turns (set eos_token in its tokenizer_config.json)"
        )
    return token_id


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id training batches are padded with: the pad token, else the end-of-sequence token."""
    token_id = single_token_id(tokenizer.pad_token_id)
    return eos_token_id(tokenizer) if token_id is None else token_id


def decode_text(
    tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int], *, skip_special_tokens: bool
) -> str:
    """The text of one sequence of ids."""
    # `decode` is typed for a batch too (`str | list[str]`); one flat sequence gives one string.
    return cast(str, tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))


def model_end_token_ids(model_folder: str | os.PathLike[str]) -> tuple[int, ...]:
    """The end ids the model's own files declare: `eos_token_id` of `config.json` and of
    `generation_config.json` (an int or a list), in that order, without repeats.

    SGLang stops every request at these whatever its stop ids (0.5.23,
    `ModelConfig._get_hf_eos_token_id`), so the engines and the abort cut stop there too; Qwen3's
    generation config adds `<|endoftext|>` (151643) to its `<|im_end|>`. A hub id or a folder
    without the files declares none.
    """
    found: list[int] = []
    for file_name in ("config.json", "generation_config.json"):
        path = Path(model_folder) / file_name
        if not path.is_file():
            continue
        declared = json.loads(path.read_text()).get("eos_token_id")
        values = declared if isinstance(declared, list) else [declared]
        found += [value for value in values if isinstance(value, int)]
    return tuple(dict.fromkeys(found))


def policy_end_token_ids(
    model_folder: str | os.PathLike[str], declared: Iterable[int]
) -> tuple[int, ...]:
    """The model's end ids: those its folder's files declare (:func:`model_end_token_ids`), then
    `declared` (`policy.end_token_ids`, for a hub id whose files are not on this machine),
    without repeats."""
    return tuple(dict.fromkeys((*model_end_token_ids(model_folder), *declared)))

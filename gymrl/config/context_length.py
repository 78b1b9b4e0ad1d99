"""The model's context against the episode's: checked at composition time, applied to both engines.

An episode longer than the positions a model was trained on is refused by SGLang at start-up
(`--context-length` above the model's derived context) and, worse, trained on silently by
Megatron with rotary angles it never saw. So before anything starts, the model's native context
(`max_position_embeddings` of its `config.json` when `policy.path` is a local folder, else
`policy.native_context_length` as declared) is compared with `policy.max_total_sequence_length`.
A longer episode needs YaRN (`policy.yarn`), an explicit choice that this module turns into the
same RoPE scaling for both sides: SGLang's `--json-model-override-args` and Megatron's
`position_embedding_type="yarn"` provider attributes.

Torch- and Ray-free, like the rest of `gymrl.config`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gymrl.config.schema.policy import PolicyConfig, YarnConfig
from nemo_gym_ext.config_errors import ConfigIssue

# SmolLM2-135M-Instruct (its wheel's config.json) and the tiny random Llama built from it.
EMBEDDED_CONTEXT_LENGTH = 8192
# HF's YaRN defaults (`_compute_yarn_parameters`), which SGLang also uses: Megatron must match.
_YARN_BETA_FAST = 32.0
_YARN_BETA_SLOW = 1.0


def local_model_config(policy: PolicyConfig) -> Path | None:
    """`<path>/config.json` when `policy.path` is a local folder, else None (a hub id)."""
    if policy.source != "pretrained" or policy.path is None:
        return None
    folder = Path(policy.path).expanduser()
    return folder / "config.json" if folder.is_dir() else None


def context_issues(policy: PolicyConfig) -> list[ConfigIssue]:
    """What is wrong between the model's native context, YaRN and the episode length."""
    native, source, issues = _native_context(policy)
    if native is None:
        return issues
    limit = native
    if policy.yarn is not None:
        original = policy.yarn.original_max_position_embeddings
        if original > native:
            issues.append(
                ConfigIssue(
                    "policy.yarn.original_max_position_embeddings",
                    original,
                    f"is larger than the model's native context ({native}, {source})",
                    "set it to the context the model was pre-trained with (at most "
                    f"{native}; Qwen3: 32768)",
                )
            )
            return issues
        limit = yarn_context_length(policy.yarn)
    length = policy.max_total_sequence_length
    if length > limit:
        if policy.yarn is None:
            fix = (
                f"lower it to {native} or less, or enable YaRN for both engines: "
                f"policy.yarn={{factor: {_factor_for(length, native)}, "
                f"original_max_position_embeddings: {native}}} (use the original length the "
                "model card gives)"
            )
            why = f"exceeds the model's native context of {native} tokens ({source})"
        else:
            fix = (
                f"lower it to {limit} or less, or raise policy.yarn.factor to "
                f"{_factor_for(length, policy.yarn.original_max_position_embeddings)}"
            )
            why = (
                f"exceeds the YaRN-scaled context of {limit} tokens "
                f"({policy.yarn.original_max_position_embeddings} x {policy.yarn.factor})"
            )
        issues.append(ConfigIssue("policy.max_total_sequence_length", length, why, fix))
    return issues


def yarn_context_length(yarn: YarnConfig) -> int:
    return int(yarn.original_max_position_embeddings * yarn.factor)


def sglang_model_overrides(policy: PolicyConfig) -> dict[str, Any] | None:
    """The `--json-model-override-args` object for YaRN, or None without it.

    SGLang derives a model's context from `max_position_embeddings` and ignores the YaRN factor
    when `original_max_position_embeddings` is given (`get_context_length`), so both are set.
    """
    if policy.yarn is None:
        return None
    return {
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": policy.yarn.factor,
            "original_max_position_embeddings": policy.yarn.original_max_position_embeddings,
        },
        "max_position_embeddings": yarn_context_length(policy.yarn),
    }


def megatron_rope_overrides(policy: PolicyConfig) -> dict[str, Any]:
    """Provider attributes that give Megatron's GPT model the same YaRN as SGLang (none without).

    `GPTModel` reads them with `getattr` when `position_embedding_type == "yarn"`; mscale 1 over
    mscale_all_dim 0 gives HF's attention factor `0.1 ln(factor) + 1`, and rounding the
    correction range to integers is HF's `truncate=True` default.
    """
    if policy.yarn is None:
        return {}
    return {
        "position_embedding_type": "yarn",
        "yarn_rotary_scaling_factor": policy.yarn.factor,
        "yarn_original_max_position_embeddings": policy.yarn.original_max_position_embeddings,
        "yarn_beta_fast": _YARN_BETA_FAST,
        "yarn_beta_slow": _YARN_BETA_SLOW,
        "yarn_mscale": 1.0,
        "yarn_mscale_all_dim": 0.0,
        "yarn_correction_range_round_to_int": True,
    }


def _native_context(policy: PolicyConfig) -> tuple[int | None, str, list[ConfigIssue]]:
    declared = policy.native_context_length
    if policy.source != "pretrained":
        return EMBEDDED_CONTEXT_LENGTH, f"the embedded {policy.source} model", []
    config_json = local_model_config(policy)
    if config_json is None:
        if declared is None:
            issue = ConfigIssue(
                "policy.native_context_length",
                None,
                f"is needed: policy.path={policy.path!r} is not a local folder, so its "
                "config.json cannot be read",
                "declare the model's max_position_embeddings (its config.json; Qwen3-30B-A3B: "
                "40960), or point policy.path at a local copy",
            )
            return None, "", [issue]
        return declared, "declared in policy.native_context_length", []
    try:
        read = json.loads(config_json.read_text())["max_position_embeddings"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        issue = ConfigIssue(
            "policy.path",
            policy.path,
            f"has no readable max_position_embeddings in {config_json}: {error!r}",
            "point policy.path at a Hugging Face model folder (with its config.json)",
        )
        return None, "", [issue]
    if declared is not None and declared != read:
        issue = ConfigIssue(
            "policy.native_context_length",
            declared,
            f"disagrees with max_position_embeddings={read} in {config_json}",
            f"remove it (the local config.json is read) or set it to {read}",
        )
        return None, "", [issue]
    return int(read), f"max_position_embeddings in {config_json}", []


def _factor_for(length: int, original: int) -> float:
    """The smallest factor, in steps of 0.5, that stretches `original` to `length`."""
    halves = -(-2 * length // original)  # ceil(2 * length / original)
    return halves / 2

"""The model's context against the episode length, checked at composition time, and YaRN applied
to SGLang and Megatron alike."""

import json
from pathlib import Path

import pytest

from gymrl.config.compose import compose_raw
from gymrl.config.context_length import megatron_rope_overrides, sglang_model_overrides
from gymrl.config.schema.generation import SGLangGenerationConfig
from gymrl.generation.sglang.servers import server_command
from gymrl.preflight.validate import validate_config
from nemo_gym_ext.config_errors import ConfigError

SGLANG_MEGATRON = ["generation=sglang", "trainer=megatron", "cluster=slurm_8gpu", "dry_run=true"]


def _issues(overrides) -> dict:
    with pytest.raises(ConfigError) as raised:
        validate_config(compose_raw(overrides))
    return {issue.key: issue for issue in raised.value.issues}


def _local_model(tmp_path: Path, max_position_embeddings: int) -> list[str]:
    (tmp_path / "config.json").write_text(
        json.dumps({"max_position_embeddings": max_position_embeddings})
    )
    return [
        "policy.source=pretrained",
        f"policy.path={tmp_path}",
        "policy.name=local",
        "generation.server.max_tokens_per_turn=256",
    ]


def test_swe_bench_30b_is_consistent_and_applies_the_same_yarn_to_both_engines():
    config = validate_config(compose_raw(["+experiment=swe_bench_30b"]))
    assert config.policy.max_total_sequence_length == 65536
    overrides = sglang_model_overrides(config.policy)
    assert overrides == {
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 2.0,
            "original_max_position_embeddings": 32768,
        },
        "max_position_embeddings": 65536,
    }
    assert isinstance(config.generation, SGLangGenerationConfig)
    command = server_command(config.generation, config.policy, model_path="/m", port=1, seed=0)
    flag = command.index("--json-model-override-args")
    assert json.loads(command[flag + 1]) == overrides
    assert command[command.index("--context-length") + 1] == "65536"
    rope = megatron_rope_overrides(config.policy)
    assert rope["position_embedding_type"] == "yarn"
    assert rope["yarn_rotary_scaling_factor"] == 2.0
    assert rope["yarn_original_max_position_embeddings"] == 32768


def test_swe_bench_30b_without_yarn_is_refused_with_the_fix():
    issue = _issues(["+experiment=swe_bench_30b", "policy.yarn=null"])[
        "policy.max_total_sequence_length"
    ]
    assert issue.value == 65536
    assert "native context of 40960" in issue.problem
    assert "policy.yarn={factor: 2.0" in issue.fix


def test_no_yarn_means_no_override_flag():
    config = validate_config(compose_raw(["policy=qwen3_30b_a3b", *SGLANG_MEGATRON]))
    assert sglang_model_overrides(config.policy) is None
    assert megatron_rope_overrides(config.policy) == {}
    assert isinstance(config.generation, SGLangGenerationConfig)
    command = server_command(config.generation, config.policy, model_path="/m", port=1, seed=0)
    assert "--json-model-override-args" not in command


def test_local_config_json_is_read(tmp_path):
    model = _local_model(tmp_path, 1024)
    issue = _issues([*model, *SGLANG_MEGATRON, "policy.max_total_sequence_length=2048"])[
        "policy.max_total_sequence_length"
    ]
    assert str(tmp_path / "config.json") in issue.problem and "1024" in issue.problem
    native = "policy.max_total_sequence_length=1024"
    validate_config(compose_raw([*model, *SGLANG_MEGATRON, native]))
    yarn = ["+policy.yarn.factor=2", "+policy.yarn.original_max_position_embeddings=1024"]
    validate_config(
        compose_raw([*model, *SGLANG_MEGATRON, *yarn, "policy.max_total_sequence_length=2048"])
    )


def test_declared_context_must_match_the_local_config_json(tmp_path):
    declared = "policy.native_context_length=2048"
    overrides = [*_local_model(tmp_path, 1024), *SGLANG_MEGATRON, declared]
    issue = _issues(overrides)["policy.native_context_length"]
    assert "max_position_embeddings=1024" in issue.problem and "set it to 1024" in issue.fix


def test_hub_id_needs_a_declared_context():
    overrides = ["policy=qwen3_30b_a3b", *SGLANG_MEGATRON, "policy.native_context_length=null"]
    issue = _issues(overrides)["policy.native_context_length"]
    assert "'Qwen/Qwen3-30B-A3B' is not a local folder" in issue.problem


def test_yarn_past_the_scaled_context_and_beyond_the_native_one_are_refused():
    base = ["+experiment=swe_bench_30b"]
    issue = _issues([*base, "policy.max_total_sequence_length=100000"])[
        "policy.max_total_sequence_length"
    ]
    assert "YaRN-scaled context of 65536" in issue.problem
    assert "policy.yarn.factor to 3.5" in issue.fix
    issue = _issues([*base, "policy.yarn.original_max_position_embeddings=50000"])[
        "policy.yarn.original_max_position_embeddings"
    ]
    assert "larger than the model's native context (40960" in issue.problem


def test_embedded_model_context_and_yarn_on_torch_backends():
    issue = _issues(["policy.max_total_sequence_length=16384"])["policy.max_total_sequence_length"]
    assert "8192" in issue.problem and "smollm2_wheel" in issue.problem
    yarn = ["+policy.yarn.factor=2", "+policy.yarn.original_max_position_embeddings=8192"]
    issue = _issues([*yarn, "policy.max_total_sequence_length=16384"])["policy.yarn"]
    assert "torch engine and trainer" in issue.problem

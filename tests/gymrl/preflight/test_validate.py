"""Cross-field validation: every issue carries the dotted key, the value and a fix."""

import pickle

import pytest
import yaml

import gymrl.preflight.validate as validate_module
from gymrl.cluster.placement import generation_gpus, trainer_gpus
from gymrl.config.compose import compose_raw
from gymrl.config.schema.generation import SGLangGenerationConfig
from gymrl.preflight.plan import render_plan
from gymrl.preflight.validate import validate_config
from nemo_gym_ext.config_errors import ConfigError


def _issues(overrides):
    with pytest.raises(ConfigError) as raised:
        validate_config(compose_raw(overrides))
    return {issue.key: issue for issue in raised.value.issues}


def test_router_replay_with_truncation_is_refused_for_every_shard():
    issues = _issues(["+experiment=swe_bench_30b", "policy.router_replay.enabled=true"])
    (issue,) = issues.values()  # same key for both shards: one entry per shard in the list
    assert issue.key == "policy.router_replay.enabled"
    with pytest.raises(ConfigError) as raised:
        validate_config(
            compose_raw(["+experiment=swe_bench_30b", "policy.router_replay.enabled=true"])
        )
    shards = {"openhands", "mini_swe"}
    assert {s for s in shards for i in raised.value.issues if f"'{s}'" in i.problem} == shards


def test_router_replay_without_truncation_is_the_flagships_to_turn_on():
    """The flagship's layout (SGLang, Megatron, an MoE) with truncation off takes router replay;
    the torch engine, which reports no routes, and a dense policy are refused by name."""
    config = validate_config(
        compose_raw(
            [
                "+experiment=swe_bench_30b",
                "policy.router_replay.enabled=true",
                "env.nemo_gym.truncate_noncontiguous_episodes=false",
            ]
        )
    )
    assert config.policy.router_replay.enabled
    issues = _issues(["policy.router_replay.enabled=true"])  # the default: torch, SmolLM2
    assert issues["generation.backend"].fix.startswith("set generation=sglang")
    assert issues["policy.router_replay.enabled"].problem in {
        "router replay needs an MoE policy",
        "the torch trainer does not replay MoE routing (only the Megatron trainer installs the "
        "engine's routes in its routers)",
    }


def test_an_expert_parallel_degree_that_does_not_divide_the_experts_is_refused():
    issues = _issues(
        [
            "+experiment=moe_r3_cpu",
            "generation.tensor_parallel_size=3",
            "generation.expert_parallel_size=3",
            "trainer.expert_model_parallel_size=3",
            "cluster.gpus_per_node=3",
        ]
    )
    for key in ("generation.expert_parallel_size", "trainer.expert_model_parallel_size"):
        assert issues[key].problem.startswith("the policy has 8 experts per layer"), issues
        assert issues[key].fix == f"set {key} to a divisor of 8"


def test_megatron_limits_are_reported_at_composition_time():
    issues = _issues(["+experiment=swe_bench_30b", "loss.kl_coef=0.1"])
    assert issues["loss.kl_coef"].fix == "set loss.kl_coef=0"


def test_gym_token_id_capture_in_one_shard_is_refused_naming_that_shard():
    issues = _issues(
        [
            "env=gym_launch",
            "+env.nemo_gym.config_paths=[a.yaml]",
            "env.nemo_gym.truncate_noncontiguous_episodes=true",
            "+env.nemo_gym.shards.one={}",
            "+env.nemo_gym.shards.two.token_id_capture.enabled=true",
        ]
    )
    assert set(issues) == {"env.nemo_gym[shard two].token_id_capture.enabled"}


def test_receipt_mode_is_refused_and_named_against_truncation_in_every_shard():
    with pytest.raises(ConfigError) as raised:
        validate_config(compose_raw(["+experiment=swe_bench_30b", "token_capture.enabled=true"]))
    problems = [i.problem for i in raised.value.issues if i.key == "token_capture.enabled"]
    assert any(p.startswith("receipt mode is not implemented") for p in problems)
    assert {s for s in ("openhands", "mini_swe") for p in problems if f"'{s}'" in p} == {
        "openhands",
        "mini_swe",
    }


def test_the_invented_receipt_mode_key_is_gone():
    assert "receipt_mode" not in str(compose_raw(["+experiment=swe_bench_30b"]))


def test_gym_guard_reports_alongside_unrelated_type_errors():
    issues = _issues(
        [
            "+experiment=swe_bench_30b",
            "policy.router_replay.enabled=true",
            "grpo.num_steps=many",
        ]
    )
    assert {"policy.router_replay.enabled", "grpo.num_steps"} <= set(issues)
    assert issues["grpo.num_steps"].value == "many"


def test_unknown_backend_names_the_choices():
    issues = _issues(["generation.backend=vllm"])
    issue = issues["generation.backend"]
    assert issue.value == "vllm"
    assert "torch" in issue.fix and "sglang" in issue.fix


def test_gpu_budget_and_parallelism_are_checked():
    issues = _issues(
        [
            "+experiment=swe_bench_30b",
            "generation.num_engines=40",
            "trainer.expert_model_parallel_size=6",
        ]
    )
    assert "generation.num_engines" in issues
    assert "160 GPUs, but the cluster has 128" in issues["generation.num_engines"].problem


def test_megatron_needs_gpus():
    issues = _issues(["trainer=megatron"])
    assert issues["cluster.gpus_per_node"].value == 0


def test_ep_must_divide_trainer_gpus():
    issues = _issues(["+experiment=swe_bench_30b", "trainer.expert_model_parallel_size=48"])
    assert (
        "EP x ETP x PP = 48 must divide the 64 trainer GPUs"
        in issues["trainer.expert_model_parallel_size"].problem
    )


def test_async_needs_an_off_policy_correction():
    issues = _issues(["loss.off_policy_correction.mode=none"])
    assert issues["loss.off_policy_correction.mode"].fix.startswith(
        "set loss.off_policy_correction.mode=token_truncate"
    )
    config = validate_config(
        compose_raw(["loss.off_policy_correction.mode=none", "grpo.async_enabled=false"])
    )
    assert not config.grpo.async_enabled


def test_stopping_divergences_needs_truncation_to_train_the_prefix():
    issues = _issues(["generation.server.stop_on_divergence=true"])
    issue = issues["env.nemo_gym.truncate_noncontiguous_episodes"]
    assert issue.value is False and "the first divergence stops the run" in issue.problem
    assert issue.fix == (
        "set env.nemo_gym.truncate_noncontiguous_episodes=true, or "
        "generation.server.stop_on_divergence=false"
    )
    config = validate_config(
        compose_raw(
            [
                "generation.server.stop_on_divergence=true",
                "env.nemo_gym.truncate_noncontiguous_episodes=true",
            ]
        )
    )
    assert config.generation.server.stop_on_divergence


def test_an_overlong_penalty_buffer_past_the_limit_is_named_per_agent():
    issues = _issues(
        ["+loss.episodes_per_agent.calculator_agent.overlong_penalty_buffer_tokens=64"]
    )
    issue = issues["loss.episodes_per_agent.calculator_agent.overlong_penalty_buffer_tokens"]
    assert issue.value == 64 and "(64: overlong_penalty_limit_tokens" in issue.problem
    assert "loss.episodes.overlong_penalty_buffer_tokens" not in issues
    validate_config(compose_raw(["loss.episodes.overlong_penalty_buffer_tokens=16"]))


def test_agents_need_exactly_one_of_environment_or_url():
    issues = _issues(["+env.nemo_gym.agents.calculator_agent.url=http://x"])
    assert "env.nemo_gym.agents.calculator_agent" in issues


def test_gpu_split_of_the_swe_recipe():
    config = validate_config(compose_raw(["+experiment=swe_bench_30b"]))
    assert generation_gpus(config) == 64
    assert trainer_gpus(config) == 64


def test_rendered_message_lists_key_value_and_fix():
    with pytest.raises(ConfigError) as raised:
        validate_config(compose_raw(["grpo.num_steps=0", "+trainer.optimizer.lrr=3"]))
    text = str(raised.value)
    assert "invalid config (2 problems)" in text
    assert "grpo.num_steps = 0" in text
    assert "trainer.optimizer.lrr = 3: unknown key" in text
    assert "fix: did you mean 'lr'?" in text


def test_missing_and_out_of_range_values_quote_the_field_description():
    issues = _issues(["~grpo.num_steps", "generation.max_batch_size=0"])
    assert issues["grpo.num_steps"].problem == "required key is missing"
    assert "Optimizer steps of the run" in issues["grpo.num_steps"].fix
    assert issues["generation.max_batch_size"].value == 0
    assert "Rows decoded together" in issues["generation.max_batch_size"].fix


def test_a_field_without_a_description_points_at_its_schema_module():
    issues = _issues(["policy.tiny=5"])
    assert issues["policy.tiny"].fix.endswith(
        "see the field descriptions of PolicyConfig in gymrl/config/schema/policy.py"
    )


def test_builtin_agents_name_a_known_environment_and_valid_options():
    issues = _issues(
        [
            "env.nemo_gym.agents.calculator_agent.environment=calculatr",
            "+env.nemo_gym.agents.guess_number_agent.options.max_turn=3",
            "env.nemo_gym.agents.guess_number_agent.options.max_turns=0",
        ]
    )
    env = issues["env.nemo_gym.agents.calculator_agent.environment"]
    assert env.value == "calculatr" and env.fix.startswith("did you mean 'calculator'?")
    typo = issues["env.nemo_gym.agents.guess_number_agent.options.max_turn"]
    assert typo.fix == "did you mean 'max_turns'?"
    low = issues["env.nemo_gym.agents.guess_number_agent.options.max_turns"]
    assert low.value == 0 and "Most model calls per episode" in low.fix


def test_megatron_trainer_with_the_torch_engine_is_refused_before_the_first_refit():
    issues = _issues(
        ["trainer=megatron", "cluster=slurm_8gpu", "policy=qwen2p5_math_1p5b", "dry_run=true"]
    )
    assert set(issues) == {"generation.backend"}
    issue = issues["generation.backend"]
    assert issue.value == "torch"
    assert "only SGLang loads" in issue.problem
    assert issue.fix.startswith("select generation=sglang, or trainer=torch, or train LoRA")


def test_an_explicit_compute_dtype_that_no_torch_backend_would_read_is_refused():
    issues = _issues(["+experiment=swe_bench_30b", "policy.compute_dtype=bfloat16"])
    assert set(issues) == {"policy.compute_dtype"}
    assert issues["policy.compute_dtype"].fix == (
        "leave policy.compute_dtype at auto and set policy.dtype"
    )


def test_sglang_with_the_torch_trainer_is_a_valid_pair():
    config = validate_config(
        compose_raw(
            ["generation=sglang", "cluster=slurm_8gpu", "generation.server.max_tokens_per_turn=512"]
        )
    )
    assert (config.generation.backend, config.trainer.backend) == ("sglang", "torch")


def test_sglang_cannot_serve_a_tiny_random_model():
    issues = _issues(["+experiment=smoke", "generation=sglang", "cluster=slurm_8gpu"])
    assert set(issues) == {"policy.source"}
    assert issues["policy.source"].value == "tiny_random"
    assert issues["policy.source"].fix.startswith("select generation=torch")


def test_a_role_interpreter_must_be_an_absolute_path_and_exclusive_with_an_image():
    issues = _issues(
        [
            "cluster.roles.trainer.python=envs/megatron/bin/python",
            "cluster.roles.buffer.python=/opt/envs/core/bin/python",
            "cluster.roles.buffer.image=nvcr.io/core:1",
        ]
    )
    assert set(issues) == {"cluster.roles.trainer.python", "cluster.roles.buffer.image"}
    assert issues["cluster.roles.trainer.python"].value == "envs/megatron/bin/python"
    assert "absolute path" in issues["cluster.roles.trainer.python"].problem
    assert issues["cluster.roles.buffer.image"].fix == (
        "set one of cluster.roles.buffer.python and cluster.roles.buffer.image to null"
    )


def test_a_roles_python_path_must_be_absolute_folders():
    issues = _issues(["cluster.roles.trainer.python_path=['/opt/shims','shims/megatron']"])
    (issue,) = issues.values()
    assert issue.key == "cluster.roles.trainer.python_path"
    assert issue.value == ["/opt/shims", "shims/megatron"]
    assert issue.problem.startswith("'shims/megatron' must be absolute")
    assert "${repo_path:" in issue.fix


def test_a_setup_hook_is_refused_beside_an_image():
    issues = _issues(
        ["cluster.roles.buffer.image=nvcr.io/core:1", "cluster.roles.buffer.setup_hook=m.f"]
    )
    assert set(issues) == {"cluster.roles.buffer.setup_hook"}
    assert "env_vars" in issues["cluster.roles.buffer.setup_hook"].problem


def test_megatron_builds_the_embedded_smollm2_but_not_a_tiny_random_model():
    """The embedded SmolLM2 is converted to a Hugging Face folder (gymrl.model.policy
    .model_folder), which Bridge loads; a tiny random model has no checkpoint."""
    sglang_megatron = ["generation=sglang", "trainer=megatron", "cluster=slurm_8gpu"]
    sglang_megatron.append("generation.server.max_tokens_per_turn=512")
    config = validate_config(compose_raw([*sglang_megatron, "policy=smollm2_135m"]))
    assert config.policy.source == "smollm2_wheel"
    issues = _issues([*sglang_megatron, "generation=torch", "policy.source=tiny_random"])
    assert "policy.source" in issues
    assert "a tiny random model has none" in issues["policy.source"].problem


def test_the_torch_engine_has_no_generation_role_to_place_in_an_environment():
    issues = _issues(["cluster.roles.generation.image=sglang:1"])
    (issue,) = issues.values()
    assert issue.key == "cluster.roles.generation.image"
    assert issue.fix.startswith("set cluster.roles.policy_server.image instead")


@pytest.mark.parametrize(
    "generation_override, outcome",
    [
        (None, "in the policy server's environment"),
        ("cluster.roles.generation.image=sglang:1", "with both an interpreter and an image"),
    ],
)
def test_sglang_servers_set_the_field_their_parent_policy_server_sets(generation_override, outcome):
    """The policy server starts the SGLang servers; Ray would hand them its runtime_env."""
    overrides = ["+experiment=math_1p5b", "cluster.roles.policy_server.python=/opt/core/bin/python"]
    issues = _issues([*overrides, *([generation_override] if generation_override else [])])
    (issue,) = issues.values()
    assert issue.key == "cluster.roles.generation.python"
    assert outcome in issue.problem


def test_every_role_in_its_own_environment_is_a_valid_sglang_megatron_config():
    roles = {
        "generation": "python=/opt/envs/sglang/bin/python",
        "policy_server": "python=/opt/envs/core/bin/python",
        "trainer": "image=nvcr.io/megatron:1",
        "gym_shards": "python=/opt/envs/core/bin/python",
        "buffer": "image=nvcr.io/core:1",
    }
    overrides = [f"cluster.roles.{role}.{setting}" for role, setting in roles.items()]
    config = validate_config(compose_raw(["+experiment=math_1p5b", *overrides]))
    assert config.cluster.roles.trainer.kind == "image"
    assert config.cluster.roles.generation.python == "/opt/envs/sglang/bin/python"


def test_unknown_parsers_and_templates_are_refused_with_what_the_recipe_has():
    issues = _issues(
        [
            "policy.tool_call_parser=mistral",
            "policy.reasoning_parser=deepseek",
            "policy.chat_template=no_such_template",
        ]
    )
    assert issues["policy.tool_call_parser"].value == "mistral"
    assert issues["policy.tool_call_parser"].fix == (
        "set policy.tool_call_parser to one of ['hermes', 'llama3_json']"
    )
    assert issues["policy.reasoning_parser"].fix == (
        "set policy.reasoning_parser to one of ['qwen3'] or null"
    )
    assert "smollm2_tools" in issues["policy.chat_template"].fix


def test_every_policy_file_names_parsers_and_a_template_the_recipe_has():
    for policy in ("smollm2_135m", "tiny_llama", "qwen3_30b_a3b", "qwen2p5_math_1p5b"):
        validate_config(compose_raw([f"policy={policy}"]))


def test_an_env_option_inherits_nothing_from_another():
    issues = _issues(["env=gym_join", "+env.nemo_gym.agents.calc.environment=calculator"])
    assert issues["env.nemo_gym.agents"].fix == "select env=builtin for it, or remove it"
    issues = _issues(["env=gym_launch"])
    assert set(issues) == {"env.nemo_gym.config_paths"}


def test_the_gym_shards_are_built_once_and_travel_with_the_config(monkeypatch):
    """The validator builds every shard once; the plan, the recipe and Ray's copy of the config
    (pickled into each actor) read that one build."""
    builds = []
    real_build = validate_module.build_all_gym_actor_configs

    def counted(*args, **kwargs):
        builds.append(args)
        return real_build(*args, **kwargs)

    monkeypatch.setattr(validate_module, "build_all_gym_actor_configs", counted)
    config = validate_config(compose_raw(["+experiment=swe_bench_30b"]))
    render_plan(config, "out")
    assert len(builds) == 1
    shards = config.gym_shards
    assert len(shards) > 1 and all(s.postprocess.truncate_noncontiguous_episodes for s in shards)
    assert pickle.loads(pickle.dumps(config)).gym_shards == shards
    assert config.model_copy(update={"dry_run": True}).gym_shards == shards


def test_a_config_not_made_by_the_validator_says_where_its_shards_come_from():
    config = validate_config(compose_raw([]))
    bare = type(config).model_validate(config.model_dump())
    with pytest.raises(RuntimeError, match=r"built by gymrl\.preflight\.validate\.validate_config"):
        _ = bare.gym_shards


def test_a_first_retry_backoff_above_its_maximum_is_refused_naming_both():
    with pytest.raises(ConfigError) as raised:
        validate_config(
            compose_raw(["env.rollout.retry_backoff_s=60", "env.rollout.retry_backoff_max_s=30"])
        )
    text = str(raised.value)
    assert (
        "env.rollout.retry_backoff_s=60.0 is more than env.rollout.retry_backoff_max_s=30.0" in text
    )


def test_eval_needs_k_samples_for_pass_at_k_and_a_temperature_for_several():
    issues = _issues(["eval.num_samples=2", "eval.pass_at_k=[1,4,8]", "eval.temperature=0"])
    assert issues["eval.num_samples"].value == 2
    assert "k=[4, 8]" in issues["eval.num_samples"].problem
    assert "raise eval.num_samples to 8" in issues["eval.num_samples"].fix
    assert "eval.num_samples=1" in issues["eval.temperature"].fix
    greedy_once = ["eval.num_samples=1", "eval.pass_at_k=[1]", "eval.temperature=0"]
    assert validate_config(compose_raw(greedy_once)).eval.num_samples == 1


def test_eval_k_must_be_positive():
    assert "k must be 1 or more" in _issues(["eval.pass_at_k=[0,1]"])["eval.pass_at_k"].problem


def test_read_back_with_a_disk_refit_is_refused_since_nothing_would_be_checked():
    disk = ["+experiment=math_1p5b", "generation.refit.transport=disk"]
    read_back = "generation.refit.verify_method=read_back"
    checked = [*disk, "generation.refit.verify_weights=true"]
    issue = _issues([*checked, read_back])["generation.refit.verify_method"]
    assert issue.value == "read_back" and "a disk refit" in issue.problem
    assert issue.fix == "use verify_method=weights_checker (the default), or transport=nccl"
    # The weights checker checks disk refits; an unchecked run has nothing to refuse.
    validate_config(compose_raw(checked))
    validate_config(compose_raw([*disk, read_back, "generation.refit.verify_weights=false"]))


def test_an_unknown_verify_method_is_named_with_the_choices():
    issues = _issues(["+experiment=math_1p5b", "generation.refit.verify_method=checksum"])
    issue = issues["generation.refit.verify_method"]
    assert issue.value == "checksum" and "weights_checker" in issue.problem + issue.fix


def test_failures_counted_as_a_reward_need_every_agents_failed_reward():
    issues = _issues(
        [
            "env.rollout.on_episode_error=reward",
            "+loss.episodes_per_agent.calculator_agent.overlong_mask=true",
        ]
    )
    for key in ("loss.episodes", "loss.episodes_per_agent.calculator_agent"):
        issue = issues[f"{key}.failed_reward"]
        assert "env.rollout.on_episode_error=reward" in issue.problem
        assert f"set {key}.failed_reward" in issue.fix
    validate_config(
        compose_raw(["env.rollout.on_episode_error=reward", "loss.episodes.failed_reward=0.0"])
    )


COMPACTION_AGENT = {
    "responses_api_agents": {
        "simple_agent_with_compaction": {
            "entrypoint": "app.py",
            "model_server": {"type": "responses_api_models", "name": "policy_model"},
            "context_history": {"enabled": True},
        }
    }
}


def test_a_compaction_agent_needs_the_compaction_adapter_wherever_it_is_declared(tmp_path):
    """Gym's vllm_model adapter answers required_prefix_token_ids 422: an agent with
    context_history on, inline or in a config file of config_paths, is refused with it."""
    config_file = tmp_path / "agents.yaml"
    config_file.write_text(yaml.safe_dump({"file_agent": COMPACTION_AGENT}))
    off = {"responses_api_agents": {"simple_agent": {"entrypoint": "app.py"}}}

    def raw(*overrides):
        composed = compose_raw(["env=gym_launch", *overrides])
        composed["env"]["nemo_gym"].update(
            config_paths=[str(config_file)], inline_agent=COMPACTION_AGENT, plain_agent=off
        )
        return composed

    with pytest.raises(ConfigError) as raised:
        validate_config(raw())
    issues = raised.value.issues
    assert [issue.key for issue in issues] == ["env.gym.policy_adapter"] * 2
    assert all(issue.value == "vllm_model" for issue in issues)
    assert issues[0].problem.startswith(
        "env.nemo_gym.inline_agent runs the compaction agent 'simple_agent_with_compaction' "
        "(context_history.enabled=true)"
    )
    assert issues[1].problem.startswith(f"file_agent (in config_paths entry {config_file}) runs")
    assert issues[0].fix.startswith("set env.gym.policy_adapter=vllm_model_with_compaction")
    fixed = validate_config(raw("env.gym.policy_adapter=vllm_model_with_compaction"))
    assert fixed.env.gym.policy_adapter == "vllm_model_with_compaction"


def test_a_server_root_that_is_not_a_folder_is_named(tmp_path):
    issues = _issues(
        ["+experiment=compaction_gym", f"env.gym.server_roots=[{tmp_path},{tmp_path}/none]"]
    )
    issue = issues["env.gym.server_roots[1]"]
    assert issue.value == f"{tmp_path}/none" and "not a folder" in issue.problem
    assert "env.gym.server_roots[0]" not in issues


def test_node_labels_match_by_equality_and_a_torch_engine_has_no_nodes_of_its_own():
    issues = _issues(
        [
            "+cluster.roles.trainer.node_labels={slurm-node-index:'!0'}",
            "+cluster.roles.generation.node_labels={slurm-node-index:'1'}",
        ]
    )
    assert set(issues) == {
        "cluster.roles.trainer.node_labels",
        "cluster.roles.generation.node_labels",
    }
    assert "match by equality" in issues["cluster.roles.trainer.node_labels"].problem
    fix = issues["cluster.roles.generation.node_labels"].fix
    assert fix.startswith("set cluster.roles.policy_server.node_labels instead")


def test_lora_is_off_by_default_and_validates_on_the_embedded_model():
    assert not validate_config(compose_raw([])).trainer.lora.enabled
    lora = validate_config(compose_raw(["trainer.lora.enabled=true"])).trainer.lora
    assert lora.enabled and lora.rank == 16


def test_a_lora_target_the_model_lacks_is_named_with_the_models_modules():
    issues = _issues(["trainer.lora.enabled=true", "trainer.lora.target_modules=[q_proj,qkv]"])
    (issue,) = issues.values()
    assert issue.key == "trainer.lora.target_modules"
    assert "['qkv'] are not Linear modules" in issue.problem
    assert "'gate_proj'" in issue.fix and "'v_proj'" in issue.fix


def test_a_lora_rank_above_a_targets_smaller_side_is_refused_with_the_largest_allowed():
    """The smoke run's tiny Llama: 64 wide, so no merged update has a rank above 64."""
    lora = ["+experiment=smoke", "trainer.lora.enabled=true"]
    validate_config(compose_raw([*lora, "trainer.lora.rank=64"]))
    issue = _issues([*lora, "trainer.lora.rank=65"])["trainer.lora.rank"]
    assert "at most 64" in issue.fix and "q_proj" in issue.problem


def test_lora_with_megatron_and_sglang_validates_and_an_moe_under_torch_is_refused():
    config = validate_config(
        compose_raw(
            [
                "trainer=megatron",
                "generation=sglang",
                "cluster=slurm_8gpu",
                "generation.server.max_tokens_per_turn=1024",
                "trainer.lora.enabled=true",
            ]
        )
    )
    assert config.trainer.lora.enabled and config.generation.backend == "sglang"
    moe = _issues(["policy=tiny_qwen3_moe", "trainer.lora.enabled=true"])
    assert "experts" in moe["trainer.lora.enabled"].problem


def test_lora_into_sglang_validates_and_what_sglang_cannot_serve_is_named_with_the_fix():
    """The CPU server's LoRA kernels are torch_native's; an adapter on part of a fused module
    (v_proj without q_proj, up_proj without gate_proj) is one SGLang cannot stack."""
    lora = ["+experiment=sglang_cpu_smoke", "trainer.lora.enabled=true"]
    generation = validate_config(compose_raw(lora)).generation
    assert isinstance(generation, SGLangGenerationConfig)
    assert generation.launch.lora_backend == "torch_native"
    backend = _issues([*lora, "generation.launch.lora_backend=csgmv"])
    assert "need a GPU" in backend["generation.launch.lora_backend"].problem
    assert backend["generation.launch.lora_backend"].fix.endswith("lora_backend=torch_native")
    fused = _issues([*lora, "trainer.lora.target_modules=[v_proj,gate_proj,up_proj]"])
    issue = fused["trainer.lora.target_modules"]
    assert "qkv_proj" in issue.problem and "['q_proj']" in issue.fix
    gate = _issues([*lora, "trainer.lora.target_modules=[q_proj,v_proj,up_proj]"])
    assert "['gate_proj']" in gate["trainer.lora.target_modules"].fix


_MEGATRON_LORA = [
    "trainer=megatron",
    "cluster=slurm_8gpu",
    "policy=qwen2p5_math_1p5b",
    "trainer.lora.enabled=true",
]


def test_megatron_lora_with_the_torch_engine_validates_its_adapter_refit_reaching_it():
    config = validate_config(compose_raw(_MEGATRON_LORA))
    assert config.trainer.backend == "megatron" and config.generation.backend == "torch"


def test_megatron_lora_naming_part_of_a_fused_module_is_refused_with_the_whole_set():
    partial = [*_MEGATRON_LORA, "trainer.lora.target_modules=[q_proj,v_proj,up_proj]"]
    with pytest.raises(ConfigError) as raised:
        validate_config(compose_raw(partial))
    qkv, fc1 = raised.value.issues
    assert qkv.key == fc1.key == "trainer.lora.target_modules"
    assert "one fused linear_qkv" in qkv.problem and "['k_proj'] too" in qkv.problem
    assert qkv.fix.startswith("name all of ['q_proj', 'k_proj', 'v_proj'] or none of them")
    assert "one fused linear_fc1" in fc1.problem and "['gate_proj'] too" in fc1.problem
    whole = [*_MEGATRON_LORA, "trainer.lora.target_modules=[q_proj,k_proj,v_proj,down_proj]"]
    validate_config(compose_raw(whole))


def test_megatron_lora_on_an_moe_policys_experts_is_refused_naming_attention_only():
    moe = ["+experiment=flagship_cpu", "trainer.lora.enabled=true", "dry_run=true"]
    issue = _issues(moe)["trainer.lora.target_modules"]
    assert "experts" in issue.problem and "['down_proj', 'gate_proj', 'up_proj']" in issue.problem
    assert issue.fix.startswith("set trainer.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]")

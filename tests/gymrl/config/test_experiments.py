"""Every shipped config composes and validates; typos in experiment files are named."""

import shutil
from pathlib import Path

import pytest

from gymrl.config.compose import CONFIG_DIR, compose_raw, experiment_names
from gymrl.preflight.plan import render_plan
from gymrl.preflight.validate import validate_config
from nemo_gym_ext.config_errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]


def test_the_shipped_experiments_exist():
    assert {
        "swe_bench_30b",
        "math_1p5b",
        "smoke",
        "smoke_noncontiguous",
        "truncation_ablation",
    } <= set(experiment_names())


@pytest.mark.parametrize("experiment", [None, *experiment_names()])
def test_every_experiment_composes_and_validates(experiment):
    overrides = [f"+experiment={experiment}"] if experiment else []
    config = validate_config(compose_raw(overrides))
    assert config.gym_shards


def _truncation_by_shard(experiment):
    config = validate_config(compose_raw([f"+experiment={experiment}"]))
    return {a.shard: a.postprocess.truncate_noncontiguous_episodes for a in config.gym_shards}


def test_swe_bench_30b_is_the_16_node_moe_recipe():
    config = validate_config(compose_raw(["+experiment=swe_bench_30b"]))
    assert config.policy.name == "Qwen3-30B-A3B" and config.policy.is_moe
    assert (config.cluster.num_nodes, config.cluster.gpus_per_node) == (16, 8)
    assert config.generation.backend == "sglang"
    assert config.trainer.backend == "megatron"
    assert config.trainer.tensor_model_parallel_size > 1
    assert config.trainer.expert_model_parallel_size > 1
    assert config.grpo.async_enabled
    assert set(_truncation_by_shard("swe_bench_30b").values()) == {True}


def test_flagship_cpu_keeps_the_flagships_groups_on_this_cpu():
    """+experiment=flagship_cpu: swe_bench_30b's generation and trainer backends and its model
    family (a mixture of experts, trained with expert parallelism and served with it), a Gym
    deployment launched instead of joined, async GRPO, truncation on in every shard and router
    replay off, refits checked; the CPU server and the two Megatron ranks in the venvs of this
    checkout, the ranks' processes prepared by the CPU shim found through the role's
    python_path."""
    flagship = validate_config(compose_raw(["+experiment=swe_bench_30b"]))
    config = validate_config(compose_raw(["+experiment=flagship_cpu"]))
    for part in ("generation", "trainer"):
        assert getattr(config, part).backend == getattr(flagship, part).backend
    assert (flagship.env.source, config.env.source) == ("gym_join", "gym_launch")
    assert config.grpo.async_enabled and flagship.grpo.async_enabled
    assert set(_truncation_by_shard("flagship_cpu").values()) == {True}
    assert flagship.policy.is_moe and config.policy.is_moe
    assert config.policy.source == "tiny_random_moe"
    assert not config.policy.router_replay.enabled and not flagship.policy.router_replay.enabled
    assert (
        config.trainer.expert_model_parallel_size == 2 and config.trainer.model_parallel_size == 1
    )
    assert config.cluster.total_gpus == 2  # the two ranks' GPU bundles, which the shim maps
    generation = config.generation
    assert generation.launch.device == "cpu"
    assert (generation.tensor_parallel_size, generation.expert_parallel_size) == (2, 2)
    assert generation.refit.verify_weights and generation.refit.verify_method == "weights_checker"
    assert generation.launch.env["GYMRL_CPU_WEIGHT_COMPARE"] == "1"
    assert generation.launch.python == str(ROOT / ".venv-sglang" / "bin" / "python")
    assert generation.launch.env["PYTHONPATH"] == str(ROOT / "cpu_standins" / "sglang_server")
    trainer = config.cluster.roles.trainer
    assert trainer.python == str(ROOT / ".venv-megatron" / "bin" / "python")
    assert trainer.python_path == (str(ROOT / "cpu_standins" / "megatron_trainer"),)
    assert (ROOT / "cpu_standins" / "megatron_trainer" / "megatron_on_cpu.py").is_file()
    assert trainer.setup_hook == "megatron_on_cpu.prepare_process"
    assert config.env.gym.venv == str(ROOT / ".venv-gym")
    assert config.grpo.num_steps == 3


def test_sglang_cpu_smoke_reads_back_every_refit_from_the_server():
    """SmolLM2's Llama class has SGLang's read-back, and the torch trainer broadcasts."""
    refit = validate_config(compose_raw(["+experiment=sglang_cpu_smoke"])).generation.refit
    assert (refit.transport, refit.verify_weights) == ("nccl", True)
    assert (refit.verify_method, refit.verify_every) == ("read_back", 1)


def test_math_1p5b_is_the_2_node_recipe_with_truncation():
    config = validate_config(compose_raw(["+experiment=math_1p5b"]))
    assert config.policy.name == "Qwen2.5-Math-1.5B"
    assert config.cluster.total_gpus == 8
    assert config.generation.backend == "sglang" and config.generation.num_engines == 4
    assert set(_truncation_by_shard("math_1p5b").values()) == {True}


def test_default_and_smoke_keep_truncation_off():
    config = validate_config(compose_raw([]))
    assert {a.postprocess.truncate_noncontiguous_episodes for a in config.gym_shards} == {False}
    assert set(_truncation_by_shard("smoke").values()) == {False}
    assert set(_truncation_by_shard("smoke_noncontiguous").values()) == {True}


def test_default_is_the_embedded_cpu_run():
    config = validate_config(compose_raw([]))
    assert config.policy.source == "smollm2_wheel"
    assert config.generation.backend == "torch" and config.trainer.backend == "torch"
    assert config.cluster.total_gpus == 0


@pytest.fixture
def conf_copy(tmp_path):
    target = tmp_path / "conf"
    shutil.copytree(CONFIG_DIR, target)
    return target


def test_a_typo_inside_an_experiment_file_is_rejected_by_name(conf_copy):
    (conf_copy / "experiment" / "typo.yaml").write_text(
        "# @package _global_\n"
        "trainer:\n  micro_batchsize: 2\n"
        "env:\n  nemo_gym:\n    truncate_noncontigous_episodes: true\n"
        "grpo:\n  num_step: 3\n"
    )
    raw = compose_raw(["+experiment=typo"], config_dir=conf_copy)
    with pytest.raises(ConfigError) as raised:
        validate_config(raw)
    by_key = {issue.key: issue for issue in raised.value.issues}
    assert set(by_key) == {
        "trainer.micro_batchsize",
        "env.nemo_gym.truncate_noncontigous_episodes",
        "grpo.num_step",
    }, "all errors of a config are reported at once"
    assert by_key["trainer.micro_batchsize"].fix == "did you mean 'micro_batch_size'?"
    assert by_key["grpo.num_step"].fix == "did you mean 'num_steps'?"
    assert (
        "truncate_noncontiguous_episodes"
        in by_key["env.nemo_gym.truncate_noncontigous_episodes"].fix
    )


@pytest.mark.parametrize(
    ("overrides", "deadline"),
    [
        ([], "300 s"),
        (["trainer.start_timeout_s=45"], "45 s"),
        (["+experiment=swe_bench_30b"], "1800 s"),
    ],
    ids=["torch-default", "override", "megatron-default"],
)
def test_the_plan_shows_the_trainers_start_up_deadline(overrides, deadline):
    """Per backend: a torch process loads one small model; 64 Megatron ranks load a 30B MoE."""
    config = validate_config(compose_raw(overrides))
    [training] = [line for line in render_plan(config, "out").splitlines() if "training" in line]
    assert training.endswith(f"; start-up deadline {deadline}")


def test_the_flagship_runs_check_their_refits_with_the_weights_checker():
    """Qwen models have no read-back in SGLang 0.5.23; the weights checker works for them."""
    for experiment in ("swe_bench_30b", "math_1p5b"):
        config = validate_config(compose_raw([f"+experiment={experiment}"]))
        refit = config.generation.refit
        assert refit.verify_weights and refit.verify_method == "weights_checker"
        [generation] = [
            line for line in render_plan(config, "out").splitlines() if "sglang:" in line
        ]
        assert "refit over nccl, checked by weights_checker;" in generation

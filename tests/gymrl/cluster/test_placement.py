"""Placement of every role, decided from the config alone (no Ray): the embedded default, the
two GPU experiments, the torch path on one and two GPUs, and each role's environment as the
`runtime_env` of its actors."""

import pytest
from ray.runtime_env import RuntimeEnv

from gymrl.cluster.placement import actor_options, plan_placement, runtime_env
from gymrl.config.compose import compose_raw
from gymrl.preflight.validate import validate_config


def _config(*overrides):
    return validate_config(compose_raw(list(overrides)))


def _fits_on_nodes(bundles, num_nodes, gpus_per_node):
    """Largest bundles first onto the fullest node that has room (how Ray packs one group)."""
    free = [float(gpus_per_node)] * num_nodes
    for bundle in sorted(bundles, key=lambda b: -b.get("GPU", 0.0)):
        room = [i for i, gpus in enumerate(free) if gpus >= bundle.get("GPU", 0.0)]
        if not room:
            return False
        fullest = min(room, key=lambda i: free[i])
        free[fullest] -= bundle.get("GPU", 0.0)
    return True


def test_the_cpu_default_reserves_nothing():
    placement = plan_placement(_config())
    assert placement.bundles == ()
    for role in (
        placement.generation,
        placement.policy_server,
        placement.trainer,
        placement.gym_shards,
        placement.buffer,
    ):
        assert role.gpus_per_actor == role.cpus_per_actor == 0.0 and role.bundle_of_actor == ()
        assert role.device == "cpu"
    assert actor_options(placement.trainer, 0, None) == {"num_gpus": 0.0, "num_cpus": 0.0}


def test_real_sglang_servers_on_the_cpu_reserve_nothing():
    """`+experiment=sglang_cpu_smoke`: SGLang servers with `launch.device: cpu` take no GPU and
    no bundle, like every other role of a CPU run."""
    config = _config("+experiment=sglang_cpu_smoke")
    assert config.generation.num_gpus == 0
    placement = plan_placement(config)
    assert placement.bundles == ()
    assert placement.generation.gpus_per_actor == 0.0 and placement.generation.bundle_of_actor == ()
    assert actor_options(placement.generation, 0, None) == {"num_gpus": 0.0, "num_cpus": 0.0}


def test_math_1p5b_gives_four_engines_one_gpu_each_and_the_trainer_a_whole_node():
    config = _config("+experiment=math_1p5b")
    placement = plan_placement(config)
    assert placement.bundles == (
        *[{"GPU": 1.0, "CPU": 1.0}] * 4,
        {"GPU": 4.0, "CPU": 4.0},
    )
    assert placement.generation.bundle_of_actor == (0, 1, 2, 3)
    assert placement.generation.gpus_per_actor == 1.0
    assert placement.policy_server.gpus_per_actor == 0.0  # the API in front of SGLang
    assert placement.trainer.bundle_of_actor == (4, 4, 4, 4)
    assert placement.trainer.gpus_per_actor == 1.0 and placement.trainer.device == "cuda"
    assert _fits_on_nodes(placement.bundles, 2, 4)


def test_an_eval_reserves_the_engines_alone():
    config = _config("+experiment=math_1p5b")
    placement = plan_placement(config, with_trainer=False)
    assert placement.bundles == ({"GPU": 1.0, "CPU": 1.0},) * 4
    assert placement.generation == plan_placement(config).generation  # same bundles, same GPUs
    assert placement.trainer.bundle_of_actor == () and placement.trainer.gpus_per_actor == 0.0


def test_swe_bench_30b_fills_sixteen_nodes():
    config = _config("+experiment=swe_bench_30b")
    placement = plan_placement(config)
    assert placement.bundles == (
        *[{"GPU": 4.0, "CPU": 1.0}] * 16,
        *[{"GPU": 8.0, "CPU": 8.0}] * 8,
    )
    assert placement.generation.gpus_per_actor == 4.0
    assert placement.generation.bundle_of_actor == tuple(range(16))
    # Rank r sits on node bundle 16 + r // 8: a TP group (4 consecutive ranks) shares a node.
    assert placement.trainer.bundle_of_actor == tuple(16 + rank // 8 for rank in range(64))
    assert sum(b["GPU"] for b in placement.bundles) == config.cluster.total_gpus
    assert _fits_on_nodes(placement.bundles, 16, 8)
    assert not _fits_on_nodes(placement.bundles, 15, 8)


@pytest.mark.parametrize(("gpus", "share"), [(1, 0.5), (2, 1.0)])
def test_the_torch_engine_and_trainer_each_get_a_gpu_or_share_the_only_one(gpus, share):
    placement = plan_placement(_config(f"cluster.gpus_per_node={gpus}"))
    assert placement.bundles == tuple([{"GPU": 1.0}] * gpus)
    assert placement.generation == placement.policy_server  # the engine lives in the server
    assert placement.generation.gpus_per_actor == placement.trainer.gpus_per_actor == share
    assert placement.generation.device == placement.trainer.device == "cuda"
    shared = placement.generation.bundle_of_actor == placement.trainer.bundle_of_actor
    assert shared == (gpus == 1)
    assert placement.gym_shards.device == placement.buffer.device == "cpu"


def test_a_torch_engine_on_the_cpu_leaves_every_gpu_to_the_trainer():
    """`generation.device: cpu` (+experiment=megatron_lora_cpu: the Megatron rank on the one GPU
    the CPU shim maps to the CPU, the torch engine beside it on the CPU)."""
    placement = plan_placement(_config("+experiment=megatron_lora_cpu"))
    assert placement.generation == placement.policy_server
    assert placement.generation.device == "cpu" and placement.generation.bundle_of_actor == ()
    assert placement.trainer.device == "cuda" and placement.bundles == ({"GPU": 1.0, "CPU": 1.0},)
    torch_trainer = plan_placement(_config("cluster.gpus_per_node=1", "generation.device=cpu"))
    assert torch_trainer.trainer.gpus_per_actor == 1.0 and torch_trainer.generation.device == "cpu"


def test_a_torch_trainer_next_to_sglang_takes_a_gpu_only_when_one_is_left():
    sglang = ["generation=sglang", "generation.server.max_tokens_per_turn=256"]
    left = plan_placement(_config(*sglang, "generation.num_engines=1", "cluster.gpus_per_node=2"))
    assert left.trainer.device == "cuda" and left.trainer.bundle_of_actor == (1,)
    full = plan_placement(_config(*sglang, "generation.num_engines=2", "cluster.gpus_per_node=2"))
    assert full.trainer.device == "cpu" and full.trainer.bundle_of_actor == ()


def test_each_role_carries_its_own_environment():
    config = _config(
        "+experiment=math_1p5b",
        "cluster.roles.generation.python=/opt/envs/sglang/bin/python",
        "cluster.roles.trainer.image=nvcr.io/megatron:1",
    )
    placement = plan_placement(config)
    assert placement.generation.environment.python == "/opt/envs/sglang/bin/python"
    assert placement.trainer.environment.image == "nvcr.io/megatron:1"
    for role in (placement.policy_server, placement.gym_shards, placement.buffer):
        assert role.environment.kind is None
    assert placement.trainer.bundle_of_actor == (4, 4, 4, 4)  # the GPUs are unchanged


def test_the_torch_engine_runs_in_the_policy_servers_environment():
    placement = plan_placement(_config("cluster.roles.policy_server.python=/opt/core/bin/python"))
    assert placement.generation == placement.policy_server
    assert placement.generation.environment.python == "/opt/core/bin/python"


def test_actor_options_hand_ray_the_interpreter_quoted_for_its_shell():
    placement = plan_placement(_config("cluster.roles.gym_shards.python=/opt/my envs/bin/python"))
    options = actor_options(placement.gym_shards, 0, None)
    assert options == {
        "num_gpus": 0.0,
        "num_cpus": 0.0,
        "runtime_env": {"py_executable": "'/opt/my envs/bin/python'"},
    }
    RuntimeEnv(**options["runtime_env"])  # Ray's own validation accepts it


def test_a_setup_hook_is_the_roles_worker_process_setup_hook():
    placement = plan_placement(
        _config(
            "cluster.roles.trainer.python=/opt/megatron/bin/python",
            "+cluster.roles.trainer.setup_hook=shim.prepare_process",
        )
    )
    options = actor_options(placement.trainer, 0, None, env_vars={"RANK": "0"})
    env = options["runtime_env"]
    assert env["py_executable"] == "/opt/megatron/bin/python"
    # Ray runs an actor's hook only as this variable (test_setup_hook.py runs one on Ray).
    assert env["env_vars"] == {
        "RANK": "0",
        "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR": "shim.prepare_process",
    }
    RuntimeEnv(**env)  # Ray's own validation accepts it


def test_an_image_takes_env_vars_beside_it_and_ray_accepts_the_pair():
    """The Megatron ranks add their torch.distributed variables to the trainer's image."""
    placement = plan_placement(_config("cluster.roles.trainer.image=nvcr.io/megatron:1"))
    options = actor_options(placement.trainer, 0, None, env_vars={"RANK": "0"})
    assert options["runtime_env"] == {
        "image_uri": "nvcr.io/megatron:1",
        "env_vars": {"RANK": "0"},
    }
    RuntimeEnv(**options["runtime_env"])


def test_a_roles_python_path_goes_before_the_pythonpath_its_workers_inherit():
    """Ray expands `${PYTHONPATH}` where it starts the worker (test_setup_hook.py on real Ray)."""
    placement = plan_placement(
        _config("cluster.roles.trainer.python_path=['/opt/shims','/opt/more']")
    )
    options = actor_options(placement.trainer, 0, None, env_vars={"RANK": "0"})
    assert options["runtime_env"] == {
        "env_vars": {"RANK": "0", "PYTHONPATH": "/opt/shims:/opt/more:${PYTHONPATH}"}
    }
    RuntimeEnv(**options["runtime_env"])


def test_env_vars_alone_make_a_runtime_env_and_nothing_makes_none():
    unset = plan_placement(_config()).trainer.environment
    assert runtime_env(unset, {"RANK": "3"}) == {"env_vars": {"RANK": "3"}}
    assert runtime_env(unset) == runtime_env(unset, {}) == {}


def test_node_labels_select_the_nodes_of_cpu_actors_and_of_gpu_bundles():
    """CPU roles (no bundle) get the labels as their actors' label selector; a GPU role's
    bundles carry them as bundle label selectors, and its actors only name their bundle."""
    cpu = plan_placement(
        _config(
            "+cluster.roles.policy_server.node_labels={slurm-node-index:'1'}",
            "+cluster.roles.trainer.node_labels={slurm-node-index:'0'}",
        )
    )
    assert actor_options(cpu.policy_server, 0, None)["label_selector"] == {"slurm-node-index": "1"}
    assert actor_options(cpu.trainer, 0, None)["label_selector"] == {"slurm-node-index": "0"}
    assert "label_selector" not in actor_options(cpu.gym_shards, 0, None)
    assert cpu.bundle_labels == ()

    gpu = plan_placement(
        _config(
            "+experiment=math_1p5b",
            "+cluster.roles.generation.node_labels={slurm-node-index:'0'}",
            "+cluster.roles.trainer.node_labels={slurm-node-index:'1'}",
        )
    )
    assert gpu.bundle_labels == (*[{"slurm-node-index": "0"}] * 4, {"slurm-node-index": "1"})
    options = actor_options(gpu.trainer, 0, "group")
    assert "label_selector" not in options
    assert options["scheduling_strategy"].placement_group_bundle_index == 4


def test_the_torch_engines_gpu_bundle_carries_the_policy_servers_labels():
    placement = plan_placement(
        _config(
            "cluster.gpus_per_node=2",
            "+cluster.roles.policy_server.node_labels={slurm-node:gpu-a}",
            "+cluster.roles.trainer.node_labels={slurm-node:gpu-b}",
        )
    )
    assert placement.bundle_labels == ({"slurm-node": "gpu-a"}, {"slurm-node": "gpu-b"})

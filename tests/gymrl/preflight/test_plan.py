"""The plan a dry run prints: here, the environment each role's Ray actors run in, and the
nodes they are pinned to."""

import sys

from gymrl.config.compose import compose_raw
from gymrl.preflight.plan import render_plan
from gymrl.preflight.validate import validate_config


def _environment_lines(*overrides):
    plan = render_plan(validate_config(compose_raw(list(overrides))), "out").splitlines()
    start = next(i for i, line in enumerate(plan) if line.startswith("  environments"))
    return dict(line.split(maxsplit=1) for line in plan[start + 1 : start + 6])


def test_the_plan_names_each_roles_interpreter_or_image():
    lines = _environment_lines(
        "+experiment=math_1p5b",
        "cluster.roles.generation.python=/opt/envs/sglang/bin/python",
        "cluster.roles.trainer.image=nvcr.io/megatron:1",
    )
    driver = f"the driver's interpreter ({sys.executable})"
    assert lines == {
        "generation": "python /opt/envs/sglang/bin/python; its servers: the role's interpreter",
        "policy_server": driver,
        "trainer": "image nvcr.io/megatron:1",
        "gym_shards": driver,
        "buffer": driver,
    }


def test_with_the_torch_engine_generation_runs_where_the_policy_server_does():
    lines = _environment_lines("cluster.roles.policy_server.python=/opt/core/bin/python")
    assert lines["policy_server"] == "python /opt/core/bin/python"
    assert lines["generation"] == "the policy server's (the torch engine runs inside it)"


def test_the_plan_names_a_roles_setup_hook():
    lines = _environment_lines(
        "+experiment=math_1p5b",
        "cluster.roles.trainer.python=/opt/megatron/bin/python",
        "cluster.roles.trainer.setup_hook=shim.prepare_process",
    )
    assert lines["trainer"] == (
        "python /opt/megatron/bin/python, each worker process set up by shim.prepare_process"
    )


def test_the_plan_names_what_goes_first_on_a_roles_pythonpath_and_the_servers_interpreter():
    lines = _environment_lines(
        "+experiment=math_1p5b",
        "cluster.roles.trainer.python_path=['/opt/shims','/opt/more']",
        "generation.launch.python=/opt/sglang/bin/python",
        "+generation.launch.env.PYTHONPATH=/opt/kernels",
    )
    assert (
        lines["trainer"]
        == f"the driver's interpreter ({sys.executable}), /opt/shims:/opt/more first on PYTHONPATH"
    )
    assert lines["generation"] == (
        f"the driver's interpreter ({sys.executable}); its servers: python /opt/sglang/bin/python, "
        "PYTHONPATH /opt/kernels"
    )


def test_the_plan_names_the_nodes_a_role_is_pinned_to():
    lines = _environment_lines(
        "+cluster.roles.policy_server.node_labels={slurm-node-index:'1'}",
        "+cluster.roles.trainer.node_labels={slurm-node:n0,slurm-node-index:'0'}",
    )
    driver = f"the driver's interpreter ({sys.executable})"
    assert lines["policy_server"] == f"{driver}, on nodes labelled slurm-node-index=1"
    assert lines["trainer"] == f"{driver}, on nodes labelled slurm-node=n0, slurm-node-index=0"
    assert lines["gym_shards"] == driver


def test_the_plan_names_a_lora_adapter_and_its_targets():
    overrides = ["trainer.lora.enabled=true", "trainer.lora.target_modules=[up_proj,down_proj]"]
    plan = render_plan(validate_config(compose_raw(overrides)), "out")
    (line,) = [line for line in plan.splitlines() if line.startswith("  training")]
    assert "LoRA rank 16 (alpha 32, dropout 0) on up_proj, down_proj, base frozen" in line
    plain = render_plan(validate_config(compose_raw([])), "out")
    assert "LoRA" not in plain

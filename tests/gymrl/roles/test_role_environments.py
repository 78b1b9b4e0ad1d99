"""Each role's actors start in the role's interpreter, on a real local Ray.

A fake interpreter stands for a role's environment: a script that records the process id it runs
as, then execs the real Python (same process id), so a pid in its record is an actor that Ray
started through it."""

import os
import shlex
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import ray

from gymrl.cluster.placement import actor_options, plan_placement
from gymrl.config.compose import compose_raw
from gymrl.preflight.validate import validate_config

pytestmark = pytest.mark.usefixtures("local_ray")


def fake_interpreter(folder: Path) -> tuple[Path, Path]:
    """An interpreter at `folder`/bin/python (the folder's name has a space, as paths may) and
    the file it appends each process id it runs as to."""
    bin_dir = folder / "env with space" / "bin"
    bin_dir.mkdir(parents=True)
    record = folder / "pids"
    record.touch()
    python = bin_dir / "python"
    python.write_text(
        "#!/bin/sh\n"
        f"echo $$ >> {shlex.quote(str(record))}\n"
        f'exec {shlex.quote(sys.executable)} "$@"\n'
    )
    python.chmod(0o755)
    return python, record


def pids(record: Path) -> set[int]:
    return {int(line) for line in record.read_text().split()}


@ray.remote(num_cpus=0)
class Probe:
    """Reports the process it runs in; starts a child with given options (an actor starting
    actors, as the policy server starts the SGLang servers)."""

    def where(self) -> tuple[int, str | None]:
        return os.getpid(), os.environ.get("RANK")

    def child_where(self, options: dict) -> tuple[int, str | None]:
        return ray.get(Probe.options(**options).remote().where.remote())


def _placement(*overrides):
    return plan_placement(validate_config(compose_raw(list(overrides))))


def test_a_role_runs_in_its_interpreter_and_the_others_in_the_drivers(tmp_path):
    python, record = fake_interpreter(tmp_path)
    placement = _placement(f"cluster.roles.gym_shards.python={python}")
    shard = Probe.options(**actor_options(placement.gym_shards, 0, None)).remote()
    buffer = Probe.options(**actor_options(placement.buffer, 0, None)).remote()
    shard_pid, _ = ray.get(shard.where.remote(), timeout=60)
    buffer_pid, _ = ray.get(buffer.where.remote(), timeout=60)
    assert shard_pid in pids(record)
    assert buffer_pid not in pids(record)


def test_trainer_ranks_get_their_interpreter_and_their_distributed_env_vars(tmp_path):
    """What `MegatronTrainerGroup` passes: the trainer's role plus one rank's variables."""
    python, record = fake_interpreter(tmp_path)
    placement = _placement(f"cluster.roles.trainer.python={python}")
    options = actor_options(placement.trainer, 0, None, env_vars={"RANK": "3"})
    pid, rank = ray.get(Probe.options(**options).remote().where.remote(), timeout=60)
    assert pid in pids(record) and rank == "3"


def test_sglang_servers_started_by_the_policy_server_run_in_their_own_interpreter(tmp_path):
    """Ray hands a child actor its parent's runtime_env unless the child sets its own fields."""
    core, core_record = fake_interpreter(tmp_path / "core")
    sglang, sglang_record = fake_interpreter(tmp_path / "sglang")
    placement = _placement(
        "+experiment=math_1p5b",
        f"cluster.roles.policy_server.python={core}",
        f"cluster.roles.generation.python={sglang}",
    )
    # The GPU roles' environments, on this CPU: no GPUs, no placement group.
    on_cpu = {"gpus_per_actor": 0.0, "cpus_per_actor": 0.0, "bundle_of_actor": ()}
    server_role = replace(placement.policy_server, **on_cpu)
    engine_options = actor_options(replace(placement.generation, **on_cpu), 0, None)
    server = Probe.options(**actor_options(server_role, 0, None)).remote()
    server_pid, _ = ray.get(server.where.remote(), timeout=60)
    engine_pid, _ = ray.get(server.child_where.remote(engine_options), timeout=60)
    assert server_pid in pids(core_record) and server_pid not in pids(sglang_record)
    assert engine_pid in pids(sglang_record) and engine_pid not in pids(core_record)

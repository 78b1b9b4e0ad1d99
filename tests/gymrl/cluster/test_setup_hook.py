"""`cluster.roles.<role>.setup_hook` runs in the role's Ray worker processes, on real Ray: an
actor's own runtime_env field is ignored by Ray (only the job's is run), so `actor_options` hands
it over the way Ray's job-level export does."""

import os
from pathlib import Path

import ray

from gymrl.cluster.placement import actor_options, plan_placement
from gymrl.config.compose import compose_raw
from gymrl.preflight.validate import validate_config
from tests.gymrl.cluster.setup_hook_probe import MARK


class Probe:
    def mark(self) -> tuple[str | None, int]:
        return os.environ.get(MARK), os.getpid()


def test_a_roles_setup_hook_runs_in_its_actors_process():
    config = validate_config(
        compose_raw(["+cluster.roles.buffer.setup_hook=setup_hook_probe.leave_a_mark"])
    )
    here = str(Path(__file__).parent)
    path = {"PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
    options = actor_options(plan_placement(config).buffer, 0, None, env_vars=path)
    ray.init(num_cpus=1, include_dashboard=False)
    try:
        probe = ray.remote(Probe).options(**options).remote()
        mark, pid = ray.get(probe.mark.remote(), timeout=120)
    finally:
        ray.shutdown()
    assert mark == str(pid)

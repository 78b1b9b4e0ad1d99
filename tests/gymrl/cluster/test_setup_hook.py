"""`cluster.roles.<role>.setup_hook` runs in the role's Ray worker processes, on real Ray: an
actor's own runtime_env field is ignored by Ray (only the job's is run), so `actor_options` hands
it over the way Ray's job-level export does. Its module is found through the role's
`python_path`, which goes before the PYTHONPATH the worker inherits."""

import os
from pathlib import Path

import ray

from gymrl.cluster.placement import actor_options, plan_placement
from gymrl.config.compose import compose_raw
from gymrl.preflight.validate import validate_config
from tests.gymrl.cluster.setup_hook_probe import MARK

ROOT = Path(__file__).resolve().parents[3]


class Probe:
    def mark(self) -> tuple[str | None, int, str | None]:
        return os.environ.get(MARK), os.getpid(), os.environ.get("PYTHONPATH")


def test_a_roles_setup_hook_runs_in_its_actors_process(monkeypatch):
    here = str(Path(__file__).parent)
    # What Ray's workers inherit from this process (the checkout under test, at least).
    inherited = os.environ.get("PYTHONPATH") or str(ROOT)
    monkeypatch.setenv("PYTHONPATH", inherited)
    config = validate_config(
        compose_raw(
            [
                "+cluster.roles.buffer.setup_hook=setup_hook_probe.leave_a_mark",
                f"cluster.roles.buffer.python_path=['{here}']",
            ]
        )
    )
    options = actor_options(plan_placement(config).buffer, 0, None)
    ray.init(num_cpus=1, include_dashboard=False)
    try:
        probe = ray.remote(Probe).options(**options).remote()
        mark, pid, path = ray.get(probe.mark.remote(), timeout=120)
    finally:
        ray.shutdown()
    assert mark == str(pid)
    assert path == os.pathsep.join([here, inherited])

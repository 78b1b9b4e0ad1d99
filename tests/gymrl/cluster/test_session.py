"""The cluster prologue on a real local Ray: `start_ray` starts the run's own Ray whatever else
this machine advertises, and `ClusterSession` closes everything it and its callers started in
reverse, reporting each closer that fails without losing the others, also after a failed start.
"""

import logging
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import ray
from ray.util.placement_group import remove_placement_group

import gymrl.cluster.session
from gymrl.cluster.placement import plan_placement, reserve
from gymrl.cluster.session import ClusterSession, NodeLabelsUnmatchedError, start_ray
from gymrl.config.compose import compose_raw
from gymrl.config.schema.cluster import ClusterConfig
from gymrl.preflight.validate import validate_config
from nemo_gym_ext.ports import free_port


def test_a_local_run_starts_its_own_ray_even_where_another_is_advertised(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # nothing answers there
    start_ray(ClusterConfig(cpus_per_node=1))
    try:
        assert ray.cluster_resources()["CPU"] == 1
    finally:
        ray.shutdown()


def test_a_local_ray_has_the_gpus_the_config_gives_a_node():
    """What the placement plan reserves is what Ray offers, whatever it detects: a CPU run whose
    roles map CUDA to the CPU (+experiment=flagship_cpu) places its one-GPU bundle."""
    start_ray(ClusterConfig(cpus_per_node=1, gpus_per_node=1))
    try:
        assert ray.cluster_resources().get("GPU") == 1
    finally:
        ray.shutdown()


def test_joining_an_address_where_nothing_answers_ends_at_ray_start_timeout_s():
    """`ray.init` has no deadline of its own: at an address where nothing answers it retried for
    about twelve minutes. In a child process, so that a join that hangs is cut off (90 s) and
    this process's Ray is left alone."""
    port = free_port()  # nothing listens there
    code = (
        "from gymrl.cluster.session import start_ray\n"
        "from gymrl.config.schema.cluster import ClusterConfig\n"
        f"start_ray(ClusterConfig(ray_address='127.0.0.1:{port}', ray_start_timeout_s=2))\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=90
    )
    took = time.monotonic() - started
    print(f"joining a silent address -> exit after {took:.1f} s")  # docs/reliability.md
    assert done.returncode == 1
    # Ray resolves 127.0.0.1 to the node's address, as ray.init would connect to it.
    assert re.search(
        rf"ClusterUnavailableError: cluster.ray_address='127.0.0.1:{port}' but no Ray cluster "
        rf"answers \(nothing accepted a connection at [\d.]+:{port} within "
        r"cluster.ray_start_timeout_s=2 s",
        done.stderr,
    ), done.stderr[-2000:]
    assert took < 30, f"{took:.1f} s"


@pytest.fixture
def closed(monkeypatch):
    """The closers that ran, in order: the roles' (appended by the test), the placement group's
    and Ray's (recorded around the real ones)."""
    order: list[str] = []
    remove, shutdown = gymrl.cluster.session.remove_placement_group, ray.shutdown

    def removing(group):
        order.append("the placement group")
        remove(group)

    def shutting_down():
        order.append("Ray")
        shutdown()

    monkeypatch.setattr(gymrl.cluster.session, "remove_placement_group", removing)
    monkeypatch.setattr(ray, "shutdown", shutting_down)
    sigterm = signal.getsignal(signal.SIGTERM)
    yield order
    signal.signal(signal.SIGTERM, sigterm)  # ray.init's, or the test's, would outlive the test


def _one_gpu_bundle():
    """A config whose placement reserves one (CPU-mapped) GPU bundle on a one-CPU local Ray."""
    return validate_config(compose_raw(["cluster.gpus_per_node=1", "cluster.cpus_per_node=1"]))


def test_every_closer_runs_in_reverse_and_each_failure_is_reported(closed, caplog):
    def fail(message: str):
        def close():
            closed.append(message)
            raise RuntimeError(message)

        return close

    def handler(_signum, _frame):
        pass

    with caplog.at_level(logging.WARNING), ClusterSession() as session:
        session.start(
            _one_gpu_bundle(), install_signals=lambda: signal.signal(signal.SIGTERM, handler)
        )
        assert signal.getsignal(signal.SIGTERM) is handler  # installed after ray.init's
        assert ray.get(session.group.ready(), timeout=60) is not None
        session.on_cleanup("the trainer", lambda: closed.append("the trainer"))
        session.on_cleanup("the generation server", fail("the server would not stop"))
        session.on_cleanup("the Gym shard", lambda: closed.append("the Gym shard"))
        session.on_cleanup("the logger", fail("the disk is full"))
    assert closed == [
        "the disk is full",
        "the Gym shard",
        "the server would not stop",
        "the trainer",
        "the placement group",
        "Ray",
    ]
    assert not ray.is_initialized()
    assert [r.getMessage() for r in caplog.records if r.name == gymrl.cluster.session.__name__] == [
        "the logger did not close cleanly: RuntimeError: the disk is full",
        "the generation server did not close cleanly: RuntimeError: the server would not stop",
    ]


def test_a_start_that_fails_half_way_is_undone_by_close(closed, monkeypatch):
    def unplaceable(_placement, timeout_s):
        raise TimeoutError(f"Ray could not place the run's GPU bundles within {timeout_s} s")

    monkeypatch.setattr(gymrl.cluster.session, "reserve", unplaceable)
    session = ClusterSession()
    with pytest.raises(TimeoutError, match="could not place"):
        session.start(_one_gpu_bundle())
    assert ray.is_initialized()
    session.close()
    session.close()  # a recipe's cleanup may run twice
    assert closed == ["Ray"]
    assert not ray.is_initialized()


def test_node_labels_no_node_carries_stop_the_start_naming_the_role_and_the_nodes(closed):
    """A local Ray's one node carries Ray's own labels only: the role's labels are named, with
    what the nodes carry, before any actor waits on a node that will never come; Ray is closed."""
    config = validate_config(
        compose_raw(
            ["cluster.cpus_per_node=1", "+cluster.roles.trainer.node_labels={slurm-node-index:'1'}"]
        )
    )
    session = ClusterSession()
    with pytest.raises(NodeLabelsUnmatchedError) as raised:
        session.start(config)
    session.close()
    assert closed == ["Ray"]
    assert str(raised.value).startswith(
        "cluster.roles.trainer.node_labels={'slurm-node-index': '1'} match no node of the Ray "
        "cluster (its 1 node(s) carry: none but Ray's own)"
    )


def test_a_gpu_bundle_goes_only_to_a_node_carrying_its_roles_labels():
    """`reserve` hands a role's node labels to Ray as its bundles' label selector: the local
    node's own id label places the bundle; a label no node carries leaves it unplaced, and the
    deadline's error names the selectors."""
    config = _one_gpu_bundle()
    start_ray(config.cluster)
    try:
        node = ray.get_runtime_context().get_node_id()
        planned = plan_placement(config)
        assert planned.bundles == ({"GPU": 1.0},)
        here = replace(planned, bundle_labels=({"ray.io/node-id": node},))
        remove_placement_group(reserve(here, 60))
        nowhere = replace(planned, bundle_labels=({"ray.io/node-id": "0" * len(node)},))
        with pytest.raises(TimeoutError, match=r"label selectors \[\{'ray.io/node-id': '000"):
            reserve(nowhere, 2)
    finally:
        ray.shutdown()

"""`start_ray` with `cluster.ray_address` null starts the run's own Ray, whatever else this
machine advertises: Ray's default would join that cluster instead and refuse `num_cpus`. Joining
one ends at `cluster.ray_start_timeout_s` when nothing answers."""

import os
import re
import subprocess
import sys
import time

import ray

from gymrl.cluster.ray_session import start_ray
from gymrl.config.schema.cluster import ClusterConfig
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
        "from gymrl.cluster.ray_session import start_ray\n"
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

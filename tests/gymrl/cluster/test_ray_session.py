"""`start_ray` with `cluster.ray_address` null starts the run's own Ray, whatever else this
machine advertises: Ray's default would join that cluster instead and refuse `num_cpus`."""

import ray

from gymrl.cluster.ray_session import start_ray
from gymrl.config.schema.cluster import ClusterConfig


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

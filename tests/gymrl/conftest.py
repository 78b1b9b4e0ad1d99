"""Fixtures of the gymrl tests."""

import pytest


@pytest.fixture(scope="module")
def local_ray():
    """A real local Ray for one test module (2 CPUs: a trainer actor next to a helper actor).
    Ray is imported here, not at collection: the GPU check's machine has no Ray
    (launch/gpu_check/run.sh) and still collects these tests."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()

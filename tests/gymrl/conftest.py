"""Fixtures of the gymrl tests."""

import pytest
import ray


@pytest.fixture(scope="module")
def local_ray():
    """A real local Ray for one test module (2 CPUs: a trainer actor next to a helper actor)."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()

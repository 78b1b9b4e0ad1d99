"""Join the configured Ray cluster, or start this run's own."""

from __future__ import annotations

import ray

from gymrl.config.schema.cluster import ClusterConfig


class ClusterUnavailableError(RuntimeError):
    """The configured Ray cluster cannot be reached."""


def start_ray(cluster: ClusterConfig) -> None:
    """Join the configured Ray cluster, or start a local one (`cluster.ray_address` null).

    Ray's own default (`address=None`) would join a cluster it finds on this machine (one from
    `ray start`, or RAY_ADDRESS) and then refuse `num_cpus`; "local" always starts this run's own,
    with the CPUs and GPUs the config gives a node (the placement plan's, gymrl.cluster.placement).
    """
    try:
        ray.init(
            address="local" if cluster.ray_address is None else cluster.ray_address,
            num_cpus=cluster.cpus_per_node if cluster.ray_address is None else None,
            num_gpus=cluster.gpus_per_node if cluster.ray_address is None else None,
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=False,
        )
    except ConnectionError as error:
        raise ClusterUnavailableError(
            f"cluster.ray_address={cluster.ray_address!r} but no Ray cluster answers ({error}). "
            "On Slurm, start the run with launch/ray.sub, which starts Ray first; on one machine, "
            "use cluster=local_cpu."
        ) from None

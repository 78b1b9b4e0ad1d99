"""Join the configured Ray cluster, or start this run's own."""

from __future__ import annotations

import socket
import time

import ray
from ray._private import services

from gymrl.config.schema.cluster import ClusterConfig

_PROBE_PAUSE_S = 0.5
_PROBE_CONNECT_S = 5.0


class ClusterUnavailableError(RuntimeError):
    """The configured Ray cluster cannot be reached."""


def start_ray(cluster: ClusterConfig) -> None:
    """Join the configured Ray cluster, or start a local one (`cluster.ray_address` null).

    Ray's own default (`address=None`) would join a cluster it finds on this machine (one from
    `ray start`, or RAY_ADDRESS) and then refuse `num_cpus`; "local" always starts this run's own,
    with the CPUs and GPUs the config gives a node (the placement plan's, gymrl.cluster.placement).
    Joining waits at most `cluster.ray_start_timeout_s` for the cluster to answer
    (:func:`_wait_until_answering`).
    """
    if cluster.ray_address is not None:
        _wait_until_answering(cluster.ray_address, cluster.ray_start_timeout_s)
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
        raise _unavailable(cluster.ray_address, str(error)) from None


def _wait_until_answering(address: str, timeout_s: float) -> None:
    """Return once the GCS that `ray.init(address)` would join accepts a connection; raise
    ClusterUnavailableError when it does not within `timeout_s`.

    `ray.init` takes no deadline: joining an address where nothing answers, it retries for about
    twelve minutes (Ray 2.60: 20 tries, `RAY_NUM_REDIS_GET_RETRIES`, of about 36 s each), so a
    wrong address or a dead head would hold a Slurm job that long. The address is resolved as
    `ray.init` resolves it (`auto`: RAY_ADDRESS, then the cluster this machine last started). A
    Ray Client address (`ray://`) is left to Ray, which bounds that connection itself."""
    if "://" in address:
        return
    services.find_gcs_addresses.cache_clear()  # as ray.init does: a cluster started since counts
    try:
        gcs = services.canonicalize_bootstrap_address(address)
    except ConnectionError as error:
        raise _unavailable(address, str(error)) from None
    if gcs is None:  # "local": ray.init starts one
        return
    host, _, port = gcs.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection(
                (host, int(port)), timeout=max(0.1, min(_PROBE_CONNECT_S, left))
            ):
                return
        except OSError as error:
            if time.monotonic() + _PROBE_PAUSE_S > deadline:
                raise _unavailable(
                    address,
                    f"nothing accepted a connection at {gcs} within "
                    f"cluster.ray_start_timeout_s={timeout_s:g} s: {error}",
                ) from None
        time.sleep(_PROBE_PAUSE_S)


def _unavailable(address: str | None, cause: str) -> ClusterUnavailableError:
    return ClusterUnavailableError(
        f"cluster.ray_address={address!r} but no Ray cluster answers ({cause}). "
        "On Slurm, start the run with launch/ray.sub, which starts Ray first; on one machine, "
        "use cluster=local_cpu."
    )

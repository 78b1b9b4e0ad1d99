"""The cluster prologue every recipe and benchmark shares: join the configured Ray cluster (or
start this run's own), check that it has the nodes the roles ask for, plan and reserve the
placement, and keep one stack of closers that
undoes all of it, and every role started on it, in reverse.

    session = ClusterSession()          # starts nothing: a recipe's cleanup may run before setup
    session.start(config)               # Ray, the caller's signal handlers again, the placement
    start_trainer(..., placement=session.placement, group=session.group,
                  on_cleanup=session.on_cleanup)
    session.close()                     # the trainer, the placement group, Ray

Every role start (`gymrl.roles`) takes `on_cleanup(what, close)` and pushes its closer the moment
the role exists, so a start-up that fails half-way leaves nothing running. One stack, so the order
of closing is the reverse of the order of starting, whatever started in between.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import ray
from ray._private import services
from ray.util.placement_group import remove_placement_group

from gymrl.cluster.placement import Placement, plan_placement, reserve
from gymrl.config.schema.cluster import ClusterConfig, RoleEnvironmentsConfig
from gymrl.config.schema.recipe import RecipeConfig

log = logging.getLogger(__name__)

_PROBE_PAUSE_S = 0.5
_PROBE_CONNECT_S = 5.0

OnCleanup = Callable[[str, Callable[[], object]], None]


class ClusterUnavailableError(RuntimeError):
    """The configured Ray cluster cannot be reached."""


class NodeLabelsUnmatchedError(ClusterUnavailableError):
    """A role's `node_labels` match no node of the Ray cluster."""


def check_node_labels(roles: RoleEnvironmentsConfig, nodes: list[dict[str, Any]]) -> None:
    """Raise NodeLabelsUnmatchedError when a role's `node_labels` match no alive node of `nodes`
    (`ray.nodes()`). Ray would keep such an actor or bundle pending without a word, and the run
    would stop only at its role's start-up deadline, naming a timeout instead of the labels."""
    alive = [node.get("Labels", {}) for node in nodes if node.get("Alive")]
    for role in type(roles).model_fields:
        wanted = getattr(roles, role).node_labels
        if wanted and not any(wanted.items() <= labels.items() for labels in alive):
            carried = "; ".join(
                ", ".join(f"{k}={v}" for k, v in sorted(labels.items()) if "ray.io/" not in k)
                or "none but Ray's own"
                for labels in alive
            )
            raise NodeLabelsUnmatchedError(
                f"cluster.roles.{role}.node_labels={wanted} match no node of the Ray cluster "
                f"(its {len(alive)} node(s) carry: {carried}). launch/ray.sub labels each node "
                "slurm-node=<name> and slurm-node-index=<0, 1, ...>; a local Ray has no such "
                "labels, so leave node_labels empty there"
            )


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


def close_reporting_failure(what: str, close: Callable[[], object]) -> None:
    """Run one closer of a stack: a role that does not close cleanly is reported, not raised,
    so it neither masks the error that ended the run nor keeps the closers before it from
    running."""
    try:
        close()
    except Exception as error:
        log.warning(f"{what} did not close cleanly: {type(error).__name__}: {error}")


class ClusterSession:
    """Ray, the run's placement and one stack of closers (see the module docstring).

    `placement` and `group` exist once `start` has reserved them; `group` is None when the
    placement has no bundles (no GPUs). `close` is safe after a failed `start`, before any, and
    twice: it undoes exactly what got started.
    """

    placement: Placement
    group: Any

    def __init__(self) -> None:
        self._closers = ExitStack()

    def start(
        self,
        config: RecipeConfig,
        *,
        with_trainer: bool = True,
        install_signals: Callable[[], None] | None = None,
    ) -> None:
        """Start Ray, then plan and reserve every role's place (without the trainer's GPUs when
        nothing trains: an eval). `install_signals` puts the caller's SIGINT/SIGTERM handlers
        back right after `ray.init`, which replaces the driver's SIGTERM handler with one that
        exits at once (a caller that installs its handlers only after setup passes none)."""
        start_ray(config.cluster)
        self.on_cleanup("Ray", ray.shutdown)
        if install_signals is not None:
            install_signals()
        check_node_labels(config.cluster.roles, ray.nodes())
        self.placement = plan_placement(config, with_trainer=with_trainer)
        self.group = group = reserve(self.placement, config.cluster.ray_start_timeout_s)
        if group is not None:
            self.on_cleanup("the placement group", lambda: remove_placement_group(group))

    def on_cleanup(self, what: str, close: Callable[[], object]) -> None:
        """Push `close` (named `what` in the warning should it fail) onto the stack."""
        self._closers.callback(close_reporting_failure, what, close)

    def close(self) -> None:
        """Run every closer in reverse order; a failing one is reported and the rest still run
        (`close_reporting_failure`)."""
        self._closers.close()

    def __enter__(self) -> ClusterSession:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

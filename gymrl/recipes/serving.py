"""Serve the configured policy alone, until stopped: Gym agents against a checkpoint, no training.

The same config tree and the same generation server as a training run (`GenerationServer`: the
engine behind the OpenAI-compatible policy server), started on a local or joined Ray cluster,
announced like a run's (`gymrl.generation.server.announce`), and stopped in reverse order when
`stop` is set (SIGINT or SIGTERM set it), or when an error leaves.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import ray
from ray.util.placement_group import remove_placement_group

from gymrl.cluster.placement import plan_placement, reserve
from gymrl.cluster.ray_session import start_ray
from gymrl.config.schema.recipe import RecipeConfig
from gymrl.generation.server.announce import announce_policy_server
from gymrl.generation.server.api_key import resolve_api_key
from gymrl.roles.generation_server import start_generation_server

log = logging.getLogger(__name__)


def serve_policy(config: RecipeConfig, output_dir: Path, stop: threading.Event) -> None:
    """Start the policy server, announce it, and return once `stop` is set and it is closed."""
    api_key = resolve_api_key(config.generation.server.api_key_file)  # fails before anything starts
    output_dir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as started:
        start_ray(config.cluster)
        started.callback(ray.shutdown)
        # After ray.init, which installs a SIGTERM handler that aborts the driver: a signal now
        # only asks for the orderly stop below.
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop.set())
        placement = plan_placement(config)
        group = reserve(placement, config.cluster.ray_start_timeout_s)
        if group is not None:
            started.callback(remove_placement_group, group)
        server = start_generation_server(
            config,
            output_dir=output_dir,
            torch_threads=2,  # nothing else runs: generation takes both cores of a laptop
            placement=placement,
            group=group,
            api_key=api_key,
            on_cleanup=lambda what, close: _push(started, close),
        )
        announce_policy_server(output_dir, server.policy)
        log.info("serving until interrupted (Ctrl-C or SIGTERM)")
        stop.wait()
        log.info("stopping the policy server")


def _push(stack: ExitStack, close: Callable[[], object]) -> None:
    stack.callback(close)

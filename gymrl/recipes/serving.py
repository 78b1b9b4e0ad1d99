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
from pathlib import Path

from gymrl.cluster.session import ClusterSession
from gymrl.config.schema.recipe import RecipeConfig
from gymrl.generation.server.announce import announce_policy_server
from gymrl.generation.server.api_key import resolve_api_key
from gymrl.roles.generation_server import start_generation_server

log = logging.getLogger(__name__)


def serve_policy(config: RecipeConfig, output_dir: Path, stop: threading.Event) -> None:
    """Start the policy server, announce it, and return once `stop` is set and it is closed."""
    api_key = resolve_api_key(config.generation.server.api_key_file)  # fails before anything starts
    output_dir.mkdir(parents=True, exist_ok=True)

    def stop_on_signals() -> None:
        """After ray.init, which installs a SIGTERM handler that aborts the driver: a signal now
        only asks for the orderly stop below."""
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop.set())

    with ClusterSession() as cluster:
        cluster.start(config, install_signals=stop_on_signals)
        server = start_generation_server(
            config,
            output_dir=output_dir,
            torch_threads=2,  # nothing else runs: generation takes both cores of a laptop
            placement=cluster.placement,
            group=cluster.group,
            api_key=api_key,
            on_cleanup=cluster.on_cleanup,
            episode_deadline_s=None,  # any client may call, for as long as it likes
        )
        announce_policy_server(output_dir, server.policy)
        log.info("serving until interrupted (Ctrl-C or SIGTERM)")
        stop.wait()
        log.info("stopping the policy server")

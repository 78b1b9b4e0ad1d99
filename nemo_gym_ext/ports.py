"""TCP ports for every process the recipe starts that listens: any free port for the SGLang
servers, the Megatron trainer's torch.distributed rendezvous and the weight-sync process group;
the first free port of a shard's range for a Gym head server, so shards on one node never share
ports.

Here rather than in `gymrl` because both packages need it and `nemo_gym_ext` never imports
`gymrl` (`tests/nemo_gym_ext/test_gym_side_imports.py`).
"""

from __future__ import annotations

import socket


class NoFreePortError(RuntimeError):
    """Every port of a range is taken."""


def free_port() -> int:
    """A TCP port that was free a moment ago (the caller binds it shortly after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def free_port_in_range(host: str, low: int, high: int) -> int:
    """The first port in [low, high) nothing listens on at `host`."""
    for port in range(low, high):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    raise NoFreePortError(f"no free port in [{low}, {high}) on {host}")

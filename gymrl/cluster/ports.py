"""Network helpers shared by every process that listens: SGLang servers, the torch.distributed
rendezvous of the Megatron trainer."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port that was free a moment ago (the caller binds it shortly after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]

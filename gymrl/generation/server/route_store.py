"""Where the policy server keeps each model call's routed experts until the trainer takes them
(router replay, `policy.router_replay.enabled`).

Routes stay out of Gym's JSON: an MoE model's routes are `layers x experts per token` ids per
position (384 bytes for Qwen3-30B-A3B in uint8), far more than the token ids Gym already carries
back and forth. The policy server keeps them here instead, keyed by the call's token sequence
(prompt ids plus generated ids, exactly as the answer's token bundle holds them), and the run
assembles an episode's routes from the keys of its model calls once the episode is collected
(:meth:`RouteStore.assemble`): the trajectory's prefix that ends at each call's last generated
token is that call's sequence, because a trained episode is contiguous.

Each call asks the engine only for the positions the previous call of its conversation did not
report (from the last token of the sent-back prefix on, the one the previous call sampled but
never ran through the model), so each position's routes cross the wire once; the first call
that reports a position wins, so a generated token keeps the routes it was generated with.

Two episodes of a group can generate the very same sequence; the store counts how often a key
was put and hands it out as many times. Routes nobody takes (failed episodes, calls of clients
that are not the run's) are dropped oldest first beyond `max_bytes` and counted.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gymrl.generation.types import RoutedExperts, RouteLayout


def sequence_key(token_ids: Sequence[int]) -> bytes:
    """The store's key for a model call's sequence (prompt ids plus generated ids)."""
    return hashlib.blake2b(np.asarray(token_ids, dtype=np.int64).tobytes(), digest_size=16).digest()


def routes_from(reused_token_count: int) -> int:
    """The first position a call asks routes for: the last token of the prefix its prompt
    reuses verbatim from the previous call (sampled there, never run through the model), or 0
    when the prompt was rendered whole."""
    return max(reused_token_count - 1, 0)


@dataclass(frozen=True)
class RouteStoreCounts:
    """The store's totals: calls held now, their bytes, and calls dropped unread."""

    held_calls: int
    held_bytes: int
    evicted_calls: int


class RouteStore:
    """Routes per model call, held until an episode's routes are assembled. Thread-safe: the
    policy server puts from its render worker, the run assembles from the actor's threads."""

    def __init__(self, layout: RouteLayout, *, max_bytes: int):
        if max_bytes <= 0:
            raise ValueError(f"max_bytes={max_bytes} must be > 0")
        self.layout = layout
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        # key -> [routes, times put and not yet handed out]
        self._calls: OrderedDict[bytes, list] = OrderedDict()
        self._bytes = 0
        self._evicted = 0
        self._capturing = True

    @property
    def capturing(self) -> bool:
        """Whether calls ask the engine for routes now (not during validation, whose episodes
        are never trained on)."""
        return self._capturing

    def set_capturing(self, capturing: bool) -> None:
        self._capturing = capturing

    def put(self, sequence: Sequence[int], routes: RoutedExperts) -> None:
        """Hold `routes` of the call whose sequence (prompt plus generation) is `sequence`."""
        if routes.end > len(sequence):
            raise ValueError(
                f"routes cover positions {routes.start}..{routes.end - 1}, past the call's "
                f"{len(sequence)} tokens"
            )
        key = sequence_key(sequence)
        with self._lock:
            held = self._calls.get(key)
            if held is not None:
                held[1] += 1
                return
            self._calls[key] = [routes, 1]
            self._bytes += routes.rows.nbytes
            while self._bytes > self._max_bytes and len(self._calls) > 1:
                _, (dropped, _) = self._calls.popitem(last=False)
                self._bytes -= dropped.rows.nbytes
                self._evicted += 1

    def assemble(self, token_ids: Sequence[int], call_ends: Sequence[int]) -> np.ndarray:
        """The routes of an episode whose model calls end (one past their last generated
        token) at `call_ends` in `token_ids`: one row per token, the layout's `missing` id where
        none arrived (the last token's always); each call's routes are handed out once."""
        length = len(token_ids)
        layout = self.layout
        rows = np.full(
            (length, layout.num_layers, layout.experts_per_token), layout.missing, layout.dtype
        )
        covered = np.zeros(length, dtype=bool)
        for end in call_ends:
            routes = self._take(token_ids[:end])
            if routes is None:
                continue
            fresh = ~covered[routes.start : routes.end]
            rows[routes.start : routes.end][fresh] = routes.rows[fresh]
            covered[routes.start : routes.end] = True
        return rows

    def _take(self, sequence: Sequence[int]) -> RoutedExperts | None:
        key = sequence_key(sequence)
        with self._lock:
            held = self._calls.get(key)
            if held is None:
                return None
            held[1] -= 1
            if held[1] == 0:
                del self._calls[key]
                self._bytes -= held[0].rows.nbytes
            return held[0]

    def counts(self) -> RouteStoreCounts:
        with self._lock:
            return RouteStoreCounts(len(self._calls), self._bytes, self._evicted)

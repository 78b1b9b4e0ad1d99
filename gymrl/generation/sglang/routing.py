"""Which SGLang server a request goes to: cache-aware (prefix-affine) or least-loaded.

A multi-turn episode sends, every turn, a prompt that starts with everything the episode said
before. SGLang keeps recent prefixes in each server's radix cache, so a turn that reaches the
server its episode used last only prefills the new tokens; on any other server it prefills the
whole history again (64k tokens at the end of a SWE episode). Least-loaded routing over 16
servers finds the cache about one turn in 16.

:class:`PrefixRouter` keeps, per server, an approximate copy of what that server's cache holds:
hash chains over blocks of `BLOCK_TOKENS` prompt tokens (each key names a block and everything
before it), inserted when a request is routed and when its output comes back, evicted least
recently used past `capacity_tokens`. A request goes to the server holding the longest prefix of
its prompt unless that server has `balance_slack` more requests in flight than the least busy one;
then, and when no server holds any of it, to the least busy one (ties round-robin). This is the
rule of SGLang's cache-aware router (`sglang-router`), in-process and over token ids: the engine
is token-in (`--skip-tokenizer-init`) and keeps its per-request control (refit resumes) without a
proxy in between. A refit flushes the servers' caches but the router keeps its copy: an episode
stays with its server, which re-caches its prefix on the next turn. Not thread-safe: the engine
calls it under its own lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal

BLOCK_TOKENS = 64
Routing = Literal["cache_aware", "least_loaded"]


def block_keys(tokens: Sequence[int], block_tokens: int = BLOCK_TOKENS) -> list[int]:
    """One key per whole block of `tokens`, naming the block and every token before it."""
    keys, key = [], 0
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        key = hash((key, tuple(tokens[start : start + block_tokens])))
        keys.append(key)
    return keys


class PrefixRouter:
    def __init__(
        self,
        num_servers: int,
        *,
        routing: Routing,
        capacity_tokens: int = 1 << 20,
        balance_slack: int = 8,
    ) -> None:
        if num_servers < 1:
            raise ValueError(f"num_servers={num_servers} must be >= 1")
        self._routing = routing
        self._capacity_blocks = max(1, capacity_tokens // BLOCK_TOKENS)
        self._balance_slack = balance_slack
        self._cached: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_servers)]
        self.in_flight = [0] * num_servers
        self._next = 0

    def choose(self, prompt: Sequence[int]) -> int:
        """The server for `prompt`, counted as busy with it until :meth:`release`."""
        count = len(self.in_flight)
        order = [(self._next + offset) % count for offset in range(count)]
        index = min(order, key=lambda i: self.in_flight[i])
        keys = block_keys(prompt) if self._routing == "cache_aware" else []
        if keys:
            matched = [self._match(server, keys) for server in range(count)]
            best = max(order, key=lambda i: matched[i])
            busiest_allowed = self.in_flight[index] + self._balance_slack
            if matched[best] > 0 and self.in_flight[best] <= busiest_allowed:
                index = best
            self._insert(index, keys)
        self.in_flight[index] += 1
        self._next = (index + 1) % count
        return index

    def release(self, index: int, sequence: Sequence[int] | None) -> None:
        """The request on server `index` ended; `sequence` (prompt + output) is now cached there
        (None when it failed)."""
        self.in_flight[index] -= 1
        if sequence is not None and self._routing == "cache_aware":
            self._insert(index, block_keys(sequence))

    def _match(self, server: int, keys: list[int]) -> int:
        cached = self._cached[server]
        matched = 0
        for key in keys:
            if key not in cached:
                break
            matched += 1
        return matched

    def _insert(self, server: int, keys: list[int]) -> None:
        cached = self._cached[server]
        for key in keys:
            cached[key] = None
            cached.move_to_end(key)
        while len(cached) > self._capacity_blocks:
            cached.popitem(last=False)

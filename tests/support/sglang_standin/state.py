"""One stand-in server's state, and the rule its "model" generates by: token = prompt length +
offset, offset = `WEIGHT_OFFSET` x the loaded weight version, so a test can tell which weights
produced which token.

**Radix (prefix) cache**: each finished request's prompt and output are cached in blocks of
`CACHE_BLOCK` tokens; a prompt's leading cached blocks count as `cached_tokens` and cost no
prefill time. `/flush_cache` empties it (the client flushes once per refit, after its updates,
which it sends with `flush_cache: false`).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gymrl.generation.sglang.routing import block_keys

WEIGHT_OFFSET = 1000
CACHE_BLOCK = 16


class PrefixCache:
    """Which leading blocks of token sequences a server holds, least recently used evicted."""

    def __init__(self, capacity_tokens: int) -> None:
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._capacity_blocks = max(1, capacity_tokens // CACHE_BLOCK)

    def match(self, tokens: Sequence[int]) -> int:
        """Tokens at the start of `tokens` that are cached (whole blocks only)."""
        matched = 0
        for key in block_keys(tokens, CACHE_BLOCK):
            if key not in self._blocks:
                break
            self._blocks.move_to_end(key)
            matched += CACHE_BLOCK
        return matched

    def insert(self, tokens: Sequence[int]) -> None:
        for key in block_keys(tokens, CACHE_BLOCK):
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while len(self._blocks) > self._capacity_blocks:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()


class StandInState:
    """What one stand-in server holds and records: its model (the weights and the version whose
    rule generates), its scheduler (requests running, paused, aborted), its weight-update session
    and groups, its radix cache, and every request and event, which the tests read."""

    def __init__(
        self,
        context_length: int,
        token_delay_s: float,
        prefill_s_per_token: float,
        pause_delay_s: float,
        flush_refusals: int,
        cache_tokens: int,
        model_weights: Mapping[str, torch.Tensor] | None,
    ) -> None:
        self.context_length = context_length
        self.token_delay_s = token_delay_s
        self.prefill_s_per_token = prefill_s_per_token
        self.pause_delay_s = pause_delay_s
        self.flush_refusals = flush_refusals
        self.events: list[tuple[str, Any]] = []
        self.finishes: list[dict[str, Any]] = []  # each /generate answer's finish_reason
        self.running = 0
        self.tokens_sampled = 0
        self.paused = False
        self.pause_requested = asyncio.Event()  # set when a pause arrives, before it takes effect
        self.abort_count = 0
        self.weight_version = "0"  # as the launcher starts SGLang: --weight-version 0
        self.offset = 0
        self.loaded_tensors: list[str] = []
        # The model's tensors; received values are copied in. None: it takes whatever arrives.
        self.known_names = None if model_weights is None else frozenset(model_weights)
        self.weights: dict[str, torch.Tensor] = {
            name: tensor.detach().clone() for name, tensor in (model_weights or {}).items()
        }
        self.received: list[list[tuple[str, str, list[int]]]] = []  # per update call
        self.skipped: list[str] = []  # names load_weights did not know
        self.snapshot: dict[str, torch.Tensor] | None = None  # /weights_checker's
        self.groups: dict[str, Any] = {}
        # A flattened bucket's receive buffer, by its (names, dtypes, shapes); without
        # `model_weights` the model's tensors are views of these.
        self.bucket_buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self.session_open = False
        self.update_lock = asyncio.Lock()  # SGLang's writer lock: one update at a time
        self.requests: list[tuple[str, Any]] = []  # (route, JSON body) of every request
        self.resume = asyncio.Event()  # set while generation runs, cleared while paused
        self.resume.set()
        self.cache = PrefixCache(cache_tokens)
        self.prompt_tokens = 0
        self.cached_tokens = 0
        # LoRA (adapters.py): the adapters loaded, by name; those being unloaded; the requests
        # running under each; `hide_adapters` answers loads without listing any.
        self.adapters: dict[str, dict[str, torch.Tensor]] = {}
        self.unloading: set[str] = set()
        self.adapter_requests: dict[str, int] = {}
        self.hide_adapters = False

    def load_weights(self, received: list[tuple[str, torch.Tensor]]) -> None:
        """The model's `load_weights`: known names copied in, unknown ones skipped."""
        for name, tensor in received:
            if self.known_names is None:
                self.weights[name] = tensor  # a view of this call's own receive buffer
            elif name in self.known_names:
                self.weights[name].copy_(tensor)
            else:
                self.skipped.append(name)

    def load_version(self, version: str) -> None:
        """The weights of `version` generate from now on (`WEIGHT_OFFSET`)."""
        self.weight_version = version
        self.offset = WEIGHT_OFFSET * int(version)

"""Keys and values the torch engine already computed, reused by prompts that start the same way.

In a multi-turn episode every turn's prompt is the previous turn's prompt, its answer and the
tool's output; and every episode of a task starts with the same system prompt, tool schema and
examples. Without reuse the engine prefills all of it again at every turn of every episode: on
the embedded calculator task that is ~400 tokens prefilled per turn for ~50 new ones, and the
prefill of one such prompt costs as much as several decoding steps of the whole batch.

So when a row finishes, the engine keeps the keys and values of everything it cached (its prompt
and what it generated, `PrefixCache.store`), and a new prompt takes the longest common token
prefix it shares with any kept entry (`PrefixCache.longest_prefix`), prefilling only the rest.
A key/value at position t depends only on tokens 0..t under causal attention, so a common prefix
of *tokens* (not of rendered text) is exactly what can be reused, wherever the two sequences part.

Entries are evicted least recently used beyond a budget of cached tokens, and every entry is
dropped when the weights change (`clear`): keys and values belong to the weights that computed
them, and a refit must not leave a row decoding against the old policy's cache.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class CachedPrefix:
    """Per-layer keys and values `[kv_heads, length, head_dim]` of a prompt's first `length`
    tokens."""

    length: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


@dataclass
class _Entry:
    tokens: np.ndarray
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


class PrefixCache:
    """Finished rows' keys and values, found by longest common token prefix; LRU within
    `max_tokens` cached tokens (0 keeps nothing). Used by the engine's loop thread only (and by a
    refit holding the model lock), so it takes no lock of its own."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self._max_tokens = max_tokens
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._tokens = 0
        self._next_id = 0

    @property
    def cached_tokens(self) -> int:
        return self._tokens

    def can_keep(self, length: int) -> bool:
        """Whether a sequence of `length` tokens fits the budget (`store` keeps it)."""
        return 0 < length <= self._max_tokens

    def longest_prefix(self, prompt: Sequence[int]) -> CachedPrefix | None:
        """The kept keys/values of `prompt`'s longest prefix shared with any entry, leaving at
        least the prompt's last token to prefill (its logits sample the first new token); None
        when no entry shares a token."""
        if not self._entries or len(prompt) < 2:
            return None
        wanted = np.asarray(prompt, dtype=np.int64)
        best_id, best = -1, 0
        for entry_id, entry in self._entries.items():
            shared = _common_prefix(entry.tokens, wanted[: len(prompt) - 1])
            if shared > best:
                best_id, best = entry_id, shared
        if not best:
            return None
        entry = self._entries[best_id]
        self._entries.move_to_end(best_id)
        return CachedPrefix(
            best,
            keys=[keys[:, :best] for keys in entry.keys],
            values=[values[:, :best] for values in entry.values],
        )

    def store(
        self, tokens: Sequence[int], keys: list[torch.Tensor], values: list[torch.Tensor]
    ) -> None:
        """Keep `keys`/`values` (per layer, `[kv_heads, len(tokens), head_dim]`, copied here so
        the caller's buffers can be freed) as the cache of `tokens`. An entry that is a prefix of
        `tokens` is replaced by it; nothing is kept if `tokens` is a prefix of an entry already."""
        length = len(tokens)
        if not self.can_keep(length):
            return
        new = np.asarray(tokens, dtype=np.int64)
        for entry_id, entry in list(self._entries.items()):
            shared = _common_prefix(entry.tokens, new)
            if shared == length:
                self._entries.move_to_end(entry_id)
                return
            if shared == len(entry.tokens):
                self._drop(entry_id)
        while self._tokens + length > self._max_tokens:
            self._drop(next(iter(self._entries)))
        self._entries[self._next_id] = _Entry(
            new,
            keys=[layer.clone() for layer in keys],
            values=[layer.clone() for layer in values],
        )
        self._next_id += 1
        self._tokens += length

    def clear(self) -> None:
        self._entries.clear()
        self._tokens = 0

    def _drop(self, entry_id: int) -> None:
        self._tokens -= len(self._entries.pop(entry_id).tokens)


# A prompt waits for an earlier prompt of its admission batch when that saves at least this many
# prompt tokens: waiting costs one more forward pass over the batch's fresh tokens, about as much
# as prefilling a few dozen tokens on a CPU.
MIN_SHARED_GAIN = 32


def plan_prefill(
    prompts: Sequence[Sequence[int]], cache: PrefixCache
) -> tuple[list[tuple[int, CachedPrefix | None]], list[int]]:
    """Which of an admission batch's prompts to prefill now (with the cached prefix each
    reuses) and which to prefill after them.

    Rows admitted together often share a long prefix no finished row has cached yet: the
    episodes of one group start from the same prompt, and after a refit every episode's system
    prompt is cold. Prefilled side by side, each would compute the shared part again. So a
    prompt that shares `MIN_SHARED_GAIN` more tokens with a prompt going now than with the
    cache waits; the engine stores what the first pass computed and the waiting prompts then
    find it in the cache. The first prompt always goes, so every pass makes progress; only a
    prompt the cache can keep is waited for, so a small budget never serialises the batch.
    """
    now: list[tuple[int, CachedPrefix | None]] = []
    later: list[int] = []
    going: list[np.ndarray] = []
    for index, prompt in enumerate(prompts):
        prefix = cache.longest_prefix(prompt)
        wanted = np.asarray(prompt[:-1], dtype=np.int64)
        shared = max((_common_prefix(other, wanted) for other in going), default=0)
        if shared >= (prefix.length if prefix else 0) + MIN_SHARED_GAIN:
            later.append(index)
            continue
        now.append((index, prefix))
        if cache.can_keep(len(prompt)):
            going.append(np.asarray(prompt, dtype=np.int64))
    return now, later


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n

"""PrefixCache: longest common token prefix, replacement of covered entries, LRU within budget."""

from __future__ import annotations

import pytest
import torch

from gymrl.generation.torch.prefix_cache import MIN_SHARED_GAIN, PrefixCache, plan_prefill

LAYERS, HEADS, DIM = 2, 3, 4


def kv(tokens: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer keys/values whose entry at position t encodes (layer, token t)."""
    base = torch.tensor(tokens, dtype=torch.float32)[None, :, None].expand(HEADS, -1, DIM)
    keys = [base + 1000 * layer for layer in range(LAYERS)]
    values = [-(base + 1000 * layer) for layer in range(LAYERS)]
    return keys, values


def store(cache: PrefixCache, tokens: list[int]) -> None:
    cache.store(tokens, *kv(tokens))


def test_the_longest_shared_prefix_wins_and_leaves_the_last_token_to_compute():
    cache = PrefixCache(max_tokens=100)
    store(cache, [1, 2, 3, 4, 5])
    store(cache, [1, 2, 9, 9])
    found = cache.longest_prefix([1, 2, 3, 4, 7, 8])
    assert found is not None and found.length == 4
    torch.testing.assert_close(found.keys[1][0, :, 0], torch.tensor([1001.0, 1002, 1003, 1004]))
    torch.testing.assert_close(found.values[0][0, :, 0], -torch.tensor([1.0, 2, 3, 4]))
    # The whole cached sequence as a prompt: its last token is still computed.
    again = cache.longest_prefix([1, 2, 3, 4, 5])
    assert again is not None and again.length == 4
    assert cache.longest_prefix([7, 1, 2]) is None
    assert cache.longest_prefix([1]) is None


def test_an_entry_extended_by_a_later_one_is_replaced():
    cache = PrefixCache(max_tokens=100)
    store(cache, [1, 2, 3])
    store(cache, [1, 2, 3, 4, 5])  # the next turn of the same episode
    assert cache.cached_tokens == 5
    store(cache, [1, 2])  # already covered
    assert cache.cached_tokens == 5


def test_least_recently_used_entries_go_beyond_the_budget():
    cache = PrefixCache(max_tokens=8)
    store(cache, [1, 1, 1])
    store(cache, [2, 2, 2])
    assert cache.longest_prefix([1, 1, 5]) is not None  # 1s now used most recently
    store(cache, [3, 3, 3])
    assert cache.cached_tokens == 6
    assert cache.longest_prefix([2, 2, 5]) is None
    assert cache.longest_prefix([1, 1, 5]) is not None
    store(cache, list(range(10, 19)))  # longer than the whole budget: not kept
    assert cache.cached_tokens == 6


def test_stored_tensors_are_copies_and_clear_forgets_everything():
    cache = PrefixCache(max_tokens=100)
    keys, values = kv([4, 5, 6])
    cache.store([4, 5, 6], keys, values)
    keys[0].zero_()
    found = cache.longest_prefix([4, 5, 6, 7])
    assert found is not None and float(found.keys[0][0, 0, 0]) == 4.0
    cache.clear()
    assert cache.cached_tokens == 0 and cache.longest_prefix([4, 5, 6, 7]) is None


def test_a_zero_budget_keeps_nothing_and_a_negative_one_is_refused():
    cache = PrefixCache(max_tokens=0)
    store(cache, [1, 2, 3])
    assert cache.longest_prefix([1, 2, 3, 4]) is None
    with pytest.raises(ValueError, match="max_tokens must be >= 0"):
        PrefixCache(max_tokens=-1)


def test_prompts_sharing_a_long_uncached_prefix_wait_for_the_first():
    cache = PrefixCache(max_tokens=1000)
    system = list(range(100, 100 + MIN_SHARED_GAIN + 8))
    prompts = [[*system, 1, 2], [*system, 3], [7, 8, 9], [*system, 4, 5]]
    now, later = plan_prefill(prompts, cache)
    assert [index for index, _ in now] == [0, 2] and later == [1, 3]
    assert all(prefix is None for _, prefix in now)
    # Once the first is cached, the others reuse it and go.
    store(cache, prompts[0])
    now, later = plan_prefill([prompts[1], prompts[3]], cache)
    assert later == [] and [p.length for _, p in now if p] == [len(system)] * 2


def test_a_short_shared_prefix_or_no_cache_does_not_wait():
    short = list(range(MIN_SHARED_GAIN - 1))
    now, later = plan_prefill([[*short, 1], [*short, 2]], PrefixCache(max_tokens=1000))
    assert later == [] and len(now) == 2
    long = list(range(MIN_SHARED_GAIN + 10))
    now, later = plan_prefill([[*long, 1], [*long, 2]], PrefixCache(max_tokens=0))
    assert later == [] and len(now) == 2


def test_a_prompt_the_cache_cannot_keep_is_not_waited_for():
    """With a budget smaller than the shared prompt, waiting would gain nothing: all go."""
    long = list(range(MIN_SHARED_GAIN + 10))
    now, later = plan_prefill([[*long, 1], [*long, 2]], PrefixCache(max_tokens=len(long)))
    assert later == [] and len(now) == 2

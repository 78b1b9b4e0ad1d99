"""Cache-aware routing: the rule on its own, and multi-turn episodes against stand-in servers."""

from gymrl.generation.sglang.engine import SGLangEngine
from gymrl.generation.sglang.routing import BLOCK_TOKENS, PrefixRouter, Routing
from gymrl.generation.types import GenerationRequest, SamplingParams
from nemo_gym_ext.http_server import serve_in_thread
from tests.support.sglang_standin import make_standin


def _prompt(seed: int, blocks: int) -> list[int]:
    return [seed * 100_000 + i for i in range(blocks * BLOCK_TOKENS)]


def test_a_prompt_follows_its_prefix_unless_that_server_is_much_busier():
    router = PrefixRouter(3, routing="cache_aware", balance_slack=2)
    first = router.choose(_prompt(1, 2))
    router.release(first, _prompt(1, 3))
    assert router.choose(_prompt(1, 4)) == first  # the next turn: same server
    assert router.choose(_prompt(1, 4)) == first  # in flight: 2 vs 0, within the slack
    assert router.choose(_prompt(1, 4)) == first
    elsewhere = router.choose(_prompt(1, 4))  # 3 in flight vs 0: past the slack
    assert elsewhere != first
    assert router.choose(_prompt(2, 2)) not in (first, elsewhere)  # unknown prefix: least busy


def test_short_prompts_and_least_loaded_routing_ignore_caches():
    router = PrefixRouter(2, routing="least_loaded")
    first = router.choose(_prompt(1, 2))
    router.release(first, _prompt(1, 3))
    assert router.choose(_prompt(1, 3)) != first  # round-robin among the idle
    affine = PrefixRouter(2, routing="cache_aware")
    short = [7] * (BLOCK_TOKENS - 1)  # no whole block: nothing to match
    assert [affine.choose(short) for _ in range(2)] == [0, 1]


def test_capacity_evicts_least_recently_used_prefixes():
    router = PrefixRouter(2, routing="cache_aware", capacity_tokens=2 * BLOCK_TOKENS)
    server = router.choose(_prompt(1, 2))  # stays in flight: this server is the busier one
    assert router.choose(_prompt(1, 2)) == server  # its prefix is there
    router.release(server, _prompt(3, 2))  # a later sequence fills the server's two blocks
    assert router.choose(_prompt(1, 2)) != server  # evicted: the least busy server instead


def _episode(routing: Routing, num_servers: int, turns: int) -> tuple[list[int], float]:
    """Requests each stand-in got and the prefix-cache hit rate over all of them."""
    standins = [make_standin(context_length=1 << 16) for _ in range(num_servers)]
    servers = [serve_in_thread(app) for app, _ in standins]
    try:
        with SGLangEngine(
            [server.url for server in servers],
            request_timeout_s=10.0,
            refit_timeout_s=10.0,
            routing=routing,
        ) as engine:
            prompt = list(range(1, 200))
            for turn in range(turns):
                [out] = engine.generate(
                    [GenerationRequest(prompt, SamplingParams(max_new_tokens=8))]
                )
                prompt = prompt + out.token_ids + [50_000 + turn] * 40  # the next user message
    finally:
        for server in servers:
            server.close()
    states = [state for _, state in standins]
    used = [sum(kind == "generate" for kind, _ in state.events) for state in states]
    hits = sum(state.cached_tokens for state in states) / sum(s.prompt_tokens for s in states)
    return sorted(used), hits


def test_a_multi_turn_episode_reaches_the_same_server_every_turn():
    used, affine_hits = _episode("cache_aware", num_servers=4, turns=12)
    assert used == [0, 0, 0, 12]
    spread, spread_hits = _episode("least_loaded", num_servers=4, turns=12)
    assert spread == [3, 3, 3, 3]
    assert affine_hits > 0.8 and affine_hits > spread_hits + 0.25

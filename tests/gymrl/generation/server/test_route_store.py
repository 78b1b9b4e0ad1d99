"""The policy server's store of routed experts per model call (router replay), and the steps of
`ChatCompletions` that ask for routes and hold them."""

from __future__ import annotations

import numpy as np
import pytest

from gymrl.generation.server.app import resolve_sampling
from gymrl.generation.server.route_store import RouteStore, routes_from
from gymrl.generation.types import GenerationOutput, RoutedExperts, RouteLayout
from tests.gymrl.generation.server.test_app_steps import USER_ONLY, completions, request

LAYOUT = RouteLayout(num_layers=3, experts_per_token=2, num_experts=8)
MISSING = LAYOUT.missing


def _routes(start: int, end: int, fill: int) -> RoutedExperts:
    rows = np.full((end - start, LAYOUT.num_layers, LAYOUT.experts_per_token), fill, np.uint8)
    return RoutedExperts(start=start, rows=rows)


def _store(max_bytes: int = 1 << 20) -> RouteStore:
    return RouteStore(LAYOUT, max_bytes=max_bytes)


def _received(rows: np.ndarray) -> int:
    """Positions with routes among those that need them (all but the last token)."""
    return int((rows[:-1, 0, 0] != MISSING).sum())


def test_an_episode_is_assembled_from_its_calls_routes():
    """Call 1 (prompt 0-4, generation 5-6) reports positions 0-5; call 2 extends it (prompt up
    to 9, generation 10-11) and reports from its sent-back prefix's last token (6) on."""
    store = _store()
    episode = list(range(100, 112))
    store.put(episode[:7], _routes(0, 6, fill=1))
    store.put(episode, _routes(routes_from(7), 11, fill=2))
    rows = store.assemble(episode, call_ends=[7, 12])
    assert _received(rows) == len(episode) - 1 == 11
    assert rows.shape == (12, 3, 2) and rows.dtype == np.uint8
    assert (rows[:6] == 1).all() and (rows[6:11] == 2).all()
    assert (rows[11] == MISSING).all()  # the last token: nothing ran it
    assert store.counts().held_calls == 0


def test_the_first_call_that_reports_a_position_wins():
    """A call rendered whole (start 0) reports positions an earlier call already did: the
    earlier routes, those the tokens were generated with, stay."""
    store = _store()
    episode = list(range(10))
    store.put(episode[:5], _routes(0, 4, fill=1))
    store.put(episode, _routes(0, 9, fill=2))
    rows = store.assemble(episode, call_ends=[5, 10])
    assert (rows[:4] == 1).all() and (rows[4:9] == 2).all()


def test_a_call_without_routes_leaves_its_positions_to_the_live_router():
    store = _store()
    episode = list(range(10))
    store.put(episode, _routes(4, 9, fill=3))  # the first call's routes never arrived
    rows = store.assemble(episode, call_ends=[5, 10])
    assert (_received(rows), len(rows) - 1) == (5, 9)
    assert (rows[:4] == MISSING).all()


def test_the_same_sequence_twice_is_handed_out_twice():
    """Two episodes of a group may generate the very same tokens."""
    store = _store()
    episode = [7, 8, 9, 10]
    store.put(episode, _routes(0, 3, fill=1))
    store.put(episode, _routes(0, 3, fill=1))
    assert store.counts().held_calls == 1
    for _ in range(2):
        assert _received(store.assemble(episode, [4])) == 3
    assert _received(store.assemble(episode, [4])) == 0


def test_routes_nobody_takes_are_dropped_oldest_first_and_counted():
    per_call = _routes(0, 10, fill=1).rows.nbytes
    store = _store(max_bytes=2 * per_call)
    for first in range(3):
        store.put([first, *range(100, 110)], _routes(0, 10, fill=1))
    counts = store.counts()
    assert (counts.held_calls, counts.held_bytes, counts.evicted_calls) == (2, 2 * per_call, 1)
    assert _received(store.assemble([0, *range(100, 110)], [11])) == 0  # the oldest went
    assert _received(store.assemble([2, *range(100, 110)], [11])) == 10


def test_routes_past_the_calls_tokens_are_refused():
    with pytest.raises(ValueError, match="past the call's 3 tokens"):
        _store().put([1, 2, 3], _routes(0, 4, fill=0))


def test_the_layout_reads_the_models_config_and_checks_routes():
    qwen3 = {"num_hidden_layers": 48, "num_experts_per_tok": 8, "num_experts": 128}
    layout = RouteLayout.of_model_config(qwen3)
    assert (layout.bytes_per_position, layout.dtype, layout.missing) == (384, np.uint8, 255)
    newer = {"num_hidden_layers": 4, "num_experts_per_tok": 2, "num_local_experts": 8}
    assert RouteLayout.of_model_config(newer).num_experts == 8
    assert RouteLayout(2, 2, 256).dtype == np.uint16
    with pytest.raises(ValueError, match="needs an MoE model"):
        RouteLayout.of_model_config({"num_hidden_layers": 30})
    with pytest.raises(ValueError, match=r"outside 0\.\.7"):
        LAYOUT.narrowed(np.full((2, 3, 2), 8))
    with pytest.raises(ValueError, match=r"expected \[positions, 3, 2\]"):
        LAYOUT.narrowed(np.zeros((2, 4, 2), int))


def test_a_call_asks_from_its_sent_back_prefixs_last_token_and_its_answer_is_held(chat_format):
    """The second call of a conversation whose first answer came back verbatim asks routes from
    the first call's last sampled token; its answer's routes are held under its sequence. While
    validation runs (the store not capturing) no call asks."""
    store = _store()
    steps = completions(chat_format, route_store=store)
    first = steps.render(request())[0]
    generated = chat_format.tokenizer("5", add_special_tokens=False)["input_ids"]
    generated += list(chat_format.stop_token_ids[:1])
    answered = {
        "role": "assistant",
        "content": "5",
        "prompt_token_ids": first.token_ids,
        "generation_token_ids": generated,
        "generation_log_probs": [-0.5] * len(generated),
    }
    body = request(messages=[*USER_ONLY, answered, {"role": "user", "content": "And 4 + 4?"}])
    prompt = steps.render(body)[0]
    assert prompt.reused_token_count == len(first.token_ids) + len(generated)
    sampling = resolve_sampling(body, None)
    asked = steps.generation_request(body, prompt, sampling)
    assert asked.routes_from == prompt.reused_token_count - 1
    store.set_capturing(False)
    assert steps.generation_request(body, prompt, sampling).routes_from is None
    store.set_capturing(True)

    output_ids = [5, 6]
    routes = _routes(asked.routes_from, len(prompt.token_ids) + 1, fill=4)
    steps.respond(
        body,
        prompt,
        GenerationOutput(output_ids, [-1.0, -1.0], "stop", 0, prompt.token_ids, routes),
    )
    sequence = prompt.token_ids + output_ids
    assert _received(store.assemble(sequence, [len(sequence)])) == len(routes.rows)

"""Episodes the policy server stopped at a divergence (`generation.server.stop_on_divergence`):
the result ends on a withheld turn (the diverged prompt, an empty generation). The postprocessor
must train exactly what truncation trains of the same episode generated to its end, classify the
divergence the same way, and leave every result alone when the server does not stop.

Each stopped result is made from a whole episode (`episode_builder`) by replacing the divergent
turn and everything after it with the answer the server gives instead."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from nemo_gym_ext.config import NemoGymPostprocessConfig
from nemo_gym_ext.metrics import per_agent_metrics
from nemo_gym_ext.postprocess import NonContiguousEpisodeError, postprocess_gym_result
from tests.support.metric_docs import documented_keys

TRUNCATE = NemoGymPostprocessConfig(truncate_noncontiguous_episodes=True)
SPLIT = NemoGymPostprocessConfig(
    truncate_noncontiguous_episodes=True, split_noncontiguous_segments=3
)


def stopped_at(episode, turn: int) -> dict:
    """`episode`'s result as the server stopping at `turn` makes it: turns before it, then the
    withheld answer to `turn`'s (diverged) prompt."""
    result = copy.deepcopy(episode.result)
    output = result["response"]["output"][: episode.item_indices[turn]]
    output.append(
        {
            "type": "message",
            "role": "assistant",
            "content": [],
            "prompt_token_ids": list(episode.prompts[turn]),
            "generation_token_ids": [],
            "generation_log_probs": [],
        }
    )
    result["response"]["output"] = output
    return result


@pytest.fixture
def diverging(episode_builder, divergence_at, turn_maker):
    return episode_builder(
        turn_maker(7, 5), divergence=divergence_at(2, "substitute", 3), non_token_items=True
    )


@pytest.mark.parametrize("config", [TRUNCATE, SPLIT], ids=["truncate", "split"])
def test_a_stopped_episode_trains_what_truncation_trains(diverging, config):
    whole = postprocess_gym_result(diverging.row, diverging.result, TRUNCATE)
    stopped = postprocess_gym_result(
        diverging.row, stopped_at(diverging, 2), config, server_stops_divergences=True
    )
    assert stopped.message_log == whole.message_log
    full = stopped.full_result
    assert full["noncontiguous_truncated"] is True
    assert full["noncontiguous_stopped"] is True
    assert full["noncontiguous_withheld"] is True
    assert full["noncontiguous_dropped_turns"] == 0  # the tail was never generated
    assert full["noncontiguous_dropped_tokens"] == 0
    assert full["trainable_turns"] == whole.full_result["trainable_turns"] == 2
    causes = {k: v for k, v in full.items() if k.startswith("noncontiguous_cause/")}
    assert causes == {
        k: v for k, v in whole.full_result.items() if k.startswith("noncontiguous_cause/")
    }
    if config is SPLIT:
        assert stopped.segments == []  # a withheld turn starts no segment
        assert full["noncontiguous_segments"] == 0


def test_a_divergence_the_server_missed_is_truncated_and_not_counted_as_stopped(diverging):
    out = postprocess_gym_result(
        diverging.row, diverging.result, TRUNCATE, server_stops_divergences=True
    )
    full = out.full_result
    assert full["noncontiguous_truncated"] is True
    assert full["noncontiguous_stopped"] is False
    assert full["noncontiguous_withheld"] is False
    assert full["noncontiguous_dropped_turns"] == 3


def test_contiguous_episodes_and_servers_that_do_not_stop_keep_todays_results(
    diverging, episode_builder, turn_maker
):
    contiguous = episode_builder(turn_maker(8, 3))
    for episode in (contiguous, diverging):
        today = postprocess_gym_result(episode.row, episode.result, TRUNCATE)
        assert "noncontiguous_stopped" not in today.full_result
        assert "noncontiguous_withheld" not in today.full_result
    stopping = postprocess_gym_result(
        contiguous.row, contiguous.result, TRUNCATE, server_stops_divergences=True
    )
    assert stopping.full_result["noncontiguous_withheld"] is False
    assert replace(stopping, withheld=None) == postprocess_gym_result(
        contiguous.row, contiguous.result, TRUNCATE
    )
    # Without the server's stop, an empty generation after the last turn is ignored as before.
    ignored = postprocess_gym_result(diverging.row, stopped_at(diverging, 2), TRUNCATE)
    assert ignored.full_result["noncontiguous_truncated"] is False
    assert "noncontiguous_stopped" not in ignored.full_result


def withheld_after_the_end(episode) -> dict:
    """`episode`'s result followed by a withheld answer whose prompt extends the history."""
    result = copy.deepcopy(episode.result)
    result["response"]["output"].append(
        {
            "type": "message",
            "role": "assistant",
            "content": [],
            "prompt_token_ids": [*episode.seen_before(len(episode.prompts)), 5, 6],
            "generation_token_ids": [],
            "generation_log_probs": [],
        }
    )
    return result


def test_a_withheld_turn_that_extends_the_history_trains_the_episode_and_is_flagged(
    episode_builder, turn_maker
):
    """The server cut the episode short although its history was contiguous: the tokens are
    trained as they are, but the episode says it was withheld (its reward is the cut-short
    state's), so the disagreement shows on the dashboard instead of passing as a whole episode."""
    episode = episode_builder(turn_maker(9, 3))
    result = withheld_after_the_end(episode)
    out = postprocess_gym_result(episode.row, result, TRUNCATE, server_stops_divergences=True)
    assert out.full_result["noncontiguous_truncated"] is False
    assert out.full_result["noncontiguous_withheld"] is True
    assert "noncontiguous_stopped" not in out.full_result
    assert (
        out.message_log == postprocess_gym_result(episode.row, episode.result, TRUNCATE).message_log
    )


def test_without_truncation_a_stopped_episode_is_the_contiguity_error(diverging):
    strict = NemoGymPostprocessConfig()
    with pytest.raises(NonContiguousEpisodeError) as stopped:
        postprocess_gym_result(
            diverging.row, stopped_at(diverging, 2), strict, server_stops_divergences=True
        )
    with pytest.raises(NonContiguousEpisodeError) as whole:
        postprocess_gym_result(diverging.row, diverging.result, strict)
    assert (stopped.value.turn, stopped.value.position, stopped.value.cause) == (
        whole.value.turn,
        whole.value.position,
        whole.value.cause,
    )


def test_every_withheld_episode_counts_in_the_documented_withheld_share(
    diverging, episode_builder, turn_maker
):
    contiguous = episode_builder(turn_maker(8, 3))
    results = [
        postprocess_gym_result(
            episode.row, result, TRUNCATE, server_stops_divergences=True
        ).full_result
        for episode, result in [
            (diverging, stopped_at(diverging, 2)),  # stopped at the divergence
            (contiguous, withheld_after_the_end(contiguous)),  # withheld, found contiguous
            (diverging, diverging.result),  # a divergence the server missed
            (contiguous, contiguous.result),  # a whole episode
        ]
    ]
    agent = results[0]["agent_ref"]["name"]
    metrics = per_agent_metrics(results)
    assert metrics[f"{agent}/noncontiguous_withheld/mean"] == 0.5
    assert metrics[f"{agent}/noncontiguous_stopped/mean"] == 0.5  # of the two truncated ones
    documented = set(documented_keys())
    for split in ("train", "validation", "eval"):
        assert f"{split}/<agent>/noncontiguous_withheld/<red>" in documented

"""`PostprocessedEpisode`, the postprocessor's typed result: it crosses the Ray boundary (a Gym
shard returns it inside `GroupOutcome.episodes`), so it pickles whole; its typed fields are what
`full_result` writes for per-agent metrics."""

from __future__ import annotations

import pickle

from nemo_gym_ext.config import NemoGymPostprocessConfig
from nemo_gym_ext.postprocess import (
    CAUSE_FIELD_PREFIX,
    UNDECODED_CAUSES,
    PostprocessedEpisode,
    postprocess_gym_result,
)
from nemo_gym_ext.rollout import GroupOutcome

SPLIT = NemoGymPostprocessConfig(
    truncate_noncontiguous_episodes=True, split_noncontiguous_segments=2
)


def _split_episode(episode_builder, divergence_at, turn_maker) -> PostprocessedEpisode:
    episode = episode_builder(turn_maker(5, 6), divergence=divergence_at(2))
    return postprocess_gym_result(episode.row, episode.result, SPLIT, server_stops_divergences=True)


def test_a_group_of_postprocessed_episodes_pickles_whole(
    episode_builder, divergence_at, turn_maker
):
    out = _split_episode(episode_builder, divergence_at, turn_maker)
    assert out.truncated and out.segments
    outcome = GroupOutcome(row_id="r", agent=out.result["agent_ref"]["name"], episodes=[out])
    back = pickle.loads(pickle.dumps(outcome))
    assert back == outcome
    assert isinstance(back.episodes[0], PostprocessedEpisode)
    assert back.episodes[0].full_result == out.full_result


def test_full_result_writes_the_typed_fields_under_the_metric_names(
    episode_builder, divergence_at, turn_maker
):
    out = _split_episode(episode_builder, divergence_at, turn_maker)
    assert out.segments is not None
    full = out.full_result
    expected = {
        "overlong": out.overlong,
        "noncontiguous_truncated": True,
        "noncontiguous_dropped_turns": out.dropped_turns,
        "malformed_sample": False,
        "trainable_turns": out.trainable_turns,
        "generated_tokens": out.generated_tokens,
        "longest_call_tokens": out.longest_call_tokens,
        "noncontiguous_withheld": False,
        "noncontiguous_stopped": False,
        "noncontiguous_dropped_tokens": out.dropped_tokens,
        "noncontiguous_segments": len(out.segments),
        "noncontiguous_segment_tokens": out.segment_tokens,
    }
    assert {key: full[key] for key in expected} == expected
    causes = {key: value for key, value in full.items() if key.startswith(CAUSE_FIELD_PREFIX)}
    assert causes == {CAUSE_FIELD_PREFIX + cause: cause == out.cause for cause in UNDECODED_CAUSES}
    assert set(full) == set(out.result) | set(expected) | set(causes)

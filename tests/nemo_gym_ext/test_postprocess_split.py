"""Split mode (`split_noncontiguous_segments`): the contiguous segments after a divergence are
kept as sequences of their own, at most N per episode, and the rest is dropped and counted.

Episodes come from the `episode_builder` fixture, with a second divergence injected by hand the
way re-rendering produces one (the history a later prompt starts from is altered)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from nemo_gym_ext.config import NemoGymPostprocessConfig, build_gym_actor_config
from nemo_gym_ext.config_errors import ConfigError
from nemo_gym_ext.postprocess import postprocess_gym_result

TRUNCATE = NemoGymPostprocessConfig(truncate_noncontiguous_episodes=True)


def split(segments: int) -> NemoGymPostprocessConfig:
    return NemoGymPostprocessConfig(
        truncate_noncontiguous_episodes=True, split_noncontiguous_segments=segments
    )


@pytest.fixture
def twice_divergent(episode_builder, divergence_at, turn_maker):
    """Six turns, diverging at turn 2 and again at turn 4 (turn 4's prompt and everything after
    start from a history whose first id changed)."""
    episode = episode_builder(turn_maker(31, 6), divergence=divergence_at(2, "substitute", 3))
    for turn in (4, 5):
        item = episode.result["response"]["output"][episode.item_indices[turn]]
        prompt = item["prompt_token_ids"]
        item["prompt_token_ids"] = [(prompt[0] + 1) % 49152, *prompt[1:]]
    return episode


def _generations(log):
    return [entry["token_ids"] for entry in log if entry["role"] == "assistant"]


@pytest.mark.parametrize("segments", [1, 2, 5])
def test_each_contiguous_segment_after_a_divergence_is_kept_up_to_the_bound(
    twice_divergent, segments
):
    episode = twice_divergent
    out = postprocess_gym_result(episode.row, episode.result, split(segments))
    output = episode.result["response"]["output"]
    prompts = [output[i]["prompt_token_ids"] for i in episode.item_indices]
    assert _generations(out.message_log) == episode.generations[:2]
    kept = min(segments, 2)
    tails = out.segments
    assert tails is not None and len(tails) == kept
    # A segment's first delta is its first turn's whole prompt; it is contiguous from there.
    assert tails[0][0]["token_ids"] == prompts[2]
    assert _generations(tails[0]) == episode.generations[2:4]
    flattened = [token for entry in tails[0] for token in entry["token_ids"]]
    assert flattened == prompts[3] + episode.generations[3]
    if kept == 2:
        assert tails[1][0]["token_ids"] == prompts[4]
        assert _generations(tails[1]) == episode.generations[4:6]
    full = out.full_result
    assert full["noncontiguous_truncated"] is True
    assert full["noncontiguous_segments"] == kept
    tail_tokens = sum(len(g) for g in episode.generations[2 : 2 + 2 * kept])
    assert full["noncontiguous_segment_tokens"] == tail_tokens
    assert full["noncontiguous_dropped_turns"] == 6 - 2 - 2 * kept
    dropped = episode.generations[2 + 2 * kept :]
    assert full["noncontiguous_dropped_tokens"] == sum(map(len, dropped))
    assert full["trainable_turns"] == 2  # the prefix, as with truncation
    assert full["noncontiguous_cause/unknown_in_history"] is True  # the first divergence's


def test_truncation_alone_drops_the_whole_tail_as_before(twice_divergent):
    out = postprocess_gym_result(twice_divergent.row, twice_divergent.result, TRUNCATE)
    assert out.segments is None
    assert out.full_result["noncontiguous_dropped_turns"] == 4
    assert "noncontiguous_segments" not in out.full_result


def test_a_contiguous_episode_has_no_segments_and_the_result_of_truncation(
    episode_builder, turn_maker
):
    episode = episode_builder(turn_maker(32, 4))
    out = postprocess_gym_result(episode.row, episode.result, split(3))
    assert out.segments == []
    assert replace(out, segments=None) == postprocess_gym_result(
        episode.row, episode.result, TRUNCATE
    )


def test_split_needs_truncation_and_is_refused_where_truncation_is():
    base = {"agents": {"calc": {"environment": "calculator"}}, "split_noncontiguous_segments": 2}
    with pytest.raises(ConfigError) as caught:
        build_gym_actor_config(
            base, source="builtin", router_replay_enabled=False, token_capture_enabled=False
        )
    (issue,) = caught.value.issues
    assert issue.key == "env.nemo_gym.split_noncontiguous_segments"
    assert "truncate_noncontiguous_episodes=true" in issue.fix
    with_truncation = {**base, "truncate_noncontiguous_episodes": True}
    for switches, key in (
        ({"router_replay_enabled": True, "token_capture_enabled": False}, "policy.router_replay"),
        ({"router_replay_enabled": False, "token_capture_enabled": True}, "token_capture"),
    ):
        with pytest.raises(ConfigError) as caught:
            build_gym_actor_config(with_truncation, source="builtin", **switches)
        assert [issue.key.startswith(key) for issue in caught.value.issues] == [True]
    gym_capture = {**with_truncation, "token_id_capture": {"enabled": True}}
    with pytest.raises(ConfigError, match=r"token_id_capture\.enabled"):
        build_gym_actor_config(
            gym_capture, source="builtin", router_replay_enabled=False, token_capture_enabled=False
        )

"""Property tests of `postprocess_gym_result` over random episodes (hypothesis).

Episodes have 1..30 trainable turns with random deltas and generations, random interleaved
non-token items and empty-generation retries, and a random divergence (or none). Small
alphabets are drawn on purpose: with ids in {0, 1} accidental partial matches are everywhere,
which is where an off-by-one in a prefix comparison would show. The builder re-checks every
episode against a plain `seen` walk, so `episode.divergent_turn` is the ground truth.
"""

from __future__ import annotations

import copy
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemo_gym_ext.config import NemoGymPostprocessConfig
from nemo_gym_ext.postprocess import NonContiguousEpisodeError, postprocess_gym_result

STRICT = NemoGymPostprocessConfig()
TRUNCATE = NemoGymPostprocessConfig(truncate_noncontiguous_episodes=True)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def episode_specs(draw):
    """Keyword arguments for `build_episode`, with the divergence as (turn, kind, position).

    Hypothesis draws the shape (turn count, lengths, alphabet, divergence, extra items); the ids
    come from a seeded generator, which keeps 150 examples of up to 30 turns fast.
    """
    alphabet = draw(st.sampled_from([2, 7, 49152]))
    count = draw(st.integers(1, 30))
    delta_lengths = draw(st.lists(st.integers(0, 12), min_size=count, max_size=count))
    generation_lengths = draw(st.lists(st.integers(1, 8), min_size=count, max_size=count))
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    delta_lengths[0] = max(1, delta_lengths[0])
    turns = [
        (
            [rng.randrange(alphabet) for _ in range(delta_length)],
            [rng.randrange(alphabet) for _ in range(generation_length)],
        )
        for delta_length, generation_length in zip(delta_lengths, generation_lengths, strict=True)
    ]
    divergence = None
    if count > 1 and draw(st.booleans()):
        divergence = (
            draw(st.integers(1, count - 1)),
            draw(st.sampled_from(["substitute", "insert"])),
            draw(st.integers(0, 10_000)),
        )
    return {
        "turns": turns,
        "divergence": divergence,
        "non_token_items": draw(st.booleans()),
        "empty_generation_after": draw(st.sets(st.integers(0, count - 1), max_size=count)),
        "reward": draw(st.floats(-10, 10, allow_nan=False)),
    }


@pytest.fixture(scope="module")
def make(episode_builder, divergence_at):
    def build(spec):
        divergence = spec["divergence"]
        return episode_builder(
            spec["turns"],
            divergence=None if divergence is None else divergence_at(*divergence),
            non_token_items=spec["non_token_items"],
            empty_generation_after=spec["empty_generation_after"],
            reward=spec["reward"],
        )

    return build


@SETTINGS
@given(spec=episode_specs())
def test_default_raises_iff_the_episode_diverges(make, spec):
    episode = make(spec)
    result_before = copy.deepcopy(episode.result)
    if episode.divergent_turn is None:
        out = postprocess_gym_result(episode.row, episode.result, STRICT, vocab_size=49152)
        assert len(out.message_log) == 2 * len(episode.prompts)
        assert out.full_result["noncontiguous_truncated"] is False
    else:
        with pytest.raises(NonContiguousEpisodeError) as caught:
            postprocess_gym_result(episode.row, episode.result, STRICT, vocab_size=49152)
        assert caught.value.turn == episode.divergent_turn
        assert caught.value.position == episode.divergent_position
    assert episode.result == result_before


@SETTINGS
@given(spec=episode_specs())
def test_truncation_keeps_exactly_the_turns_before_the_divergence(make, spec):
    episode = make(spec)
    row_before, result_before = copy.deepcopy(episode.row), copy.deepcopy(episode.result)
    out = postprocess_gym_result(episode.row, episode.result, TRUNCATE, vocab_size=49152)

    total = len(episode.prompts)
    retained = total if episode.divergent_turn is None else episode.divergent_turn
    log = out.message_log
    assert retained >= 1
    assert [entry["role"] for entry in log] == ["user", "assistant"] * retained
    for turn in range(retained):
        assert log[2 * turn]["token_ids"] == episode.delta(turn)
        assert log[2 * turn + 1]["token_ids"] == episode.generations[turn]
        assert log[2 * turn + 1]["generation_logprobs"] == episode.logprobs[turn]
    flattened = [token for entry in log for token in entry["token_ids"]]
    assert flattened == episode.prompts[retained - 1] + episode.generations[retained - 1]

    full = out.full_result
    assert full["noncontiguous_truncated"] is (retained < total)
    assert full["noncontiguous_dropped_turns"] == total - retained
    assert full["reward"] == spec["reward"]
    assert episode.row == row_before
    assert episode.result == result_before


@settings(SETTINGS, max_examples=60)
@given(spec=episode_specs())
def test_both_modes_agree_on_contiguous_episodes(make, spec):
    spec = {**spec, "divergence": None}
    episode = make(spec)
    strict = postprocess_gym_result(episode.row, episode.result, STRICT)
    truncated = postprocess_gym_result(episode.row, episode.result, TRUNCATE)
    assert strict == truncated

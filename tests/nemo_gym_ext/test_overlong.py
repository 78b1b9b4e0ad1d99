"""Overlong detection for every agent: the built-in agents' own flag and NeMo-Gym's per-call
`incomplete_details` (0.7.0's simple_agent returns the call that stopped the episode, with
`status: "incomplete"` and `incomplete_details: {reason: "max_output_tokens"}`, as its
`responses_converter` builds it from `finish_reason: "length"`), also when the contiguity
truncation dropped the turn that hit the limit."""

from __future__ import annotations

import pytest

from nemo_gym_ext.config import NemoGymPostprocessConfig
from nemo_gym_ext.overlong import PromptTooLongError, hit_token_limit, refused_before_generating
from nemo_gym_ext.postprocess import postprocess_gym_result

TRUNCATE = NemoGymPostprocessConfig(truncate_noncontiguous_episodes=True)


def _gym_response(reason: str | None) -> dict:
    """A Responses object as Gym's converter ends one model call."""
    details = None if reason is None else {"reason": reason}
    return {
        "output": [],
        "status": "completed" if details is None else "incomplete",
        "incomplete_details": details,
    }


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        ({"overlong": True}, True),
        ({"overlong": False}, False),
        ({"response": _gym_response("max_output_tokens")}, True),
        ({"response": _gym_response("content_filter")}, False),  # incomplete, not at a limit
        ({"response": _gym_response(None)}, False),
        ({"response": {"output": []}}, False),  # a stock result that says nothing
        ({}, False),
    ],
)
def test_hit_token_limit_reads_the_flag_or_gyms_incomplete_details(result, expected):
    assert hit_token_limit(result) is expected


def test_a_gym_result_cut_at_its_limit_is_overlong_after_truncation_dropped_that_turn(
    episode_builder, divergence_at, turn_maker
):
    episode = episode_builder(turn_maker(9, 4), divergence=divergence_at(2))
    result = {
        **episode.result,
        "response": {
            **episode.result["response"],
            "status": "incomplete",
            "incomplete_details": {"reason": "max_output_tokens"},
        },
    }
    out = postprocess_gym_result(episode.row, result, TRUNCATE)
    assert out.full_result["noncontiguous_truncated"] is True
    assert out.overlong is True and out.full_result["overlong"] is True
    assert "overlong" not in result  # the input is not mutated


def test_every_result_carries_the_overlong_field(episode_builder, turn_maker):
    episode = episode_builder(turn_maker(10, 2))
    assert "overlong" not in episode.result
    out = postprocess_gym_result(episode.row, episode.result, TRUNCATE)
    assert out.full_result["overlong"] is False


@pytest.mark.parametrize(
    "output",
    [
        [],
        [
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": ""}],
            }
        ],
        [{"type": "message", "role": "assistant", "content": [], "generation_token_ids": []}],
    ],
    ids=["no-item", "empty-message", "empty-generation"],
)
@pytest.mark.parametrize("on_malformed", ["raise", "mask"])
def test_a_result_at_its_limit_before_any_token_is_a_refused_prompt_even_when_masking(
    output, on_malformed
):
    """Gym's vllm_model adapter answers the policy server's 400 "maximum context length" with an
    empty `length` completion, which simple_agent returns as an incomplete response: not a
    malformed result (masking must not hide it) but the row's prompt refused."""
    row = {"id": "long-7", "agent_ref": {"name": "example_multi_step_simple_agent"}}
    result = {"reward": 0.0, "response": {**_gym_response("max_output_tokens"), "output": output}}
    config = NemoGymPostprocessConfig(on_malformed_result=on_malformed)
    with pytest.raises(PromptTooLongError, match=r"row 'long-7' .*refused the prompt"):
        postprocess_gym_result(row, result, config)
    assert refused_before_generating(result)
    assert not refused_before_generating({**result, "response": _gym_response(None)})

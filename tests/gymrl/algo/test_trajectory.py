"""Trajectory flattening from real postprocessor output, and the padded batch built from it."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from gymrl.algo.trajectory import Trajectory, collate
from nemo_gym_ext.config import NemoGymPostprocessConfig
from nemo_gym_ext.postprocess import postprocess_gym_result

ROW = {"id": "task-7", "agent_ref": {"type": "responses_api_agents", "name": "calc_agent"}}


def _result(reward=1.0, second_logprobs=(-0.3,)):
    """Two contiguous model calls: prompt [1, 2, 3] -> [4, 5], then [.., 6, 7] -> [8]."""
    return {
        **ROW,
        "reward": reward,
        "response": {
            "output": [
                {
                    "type": "function_call",
                    "prompt_token_ids": [1, 2, 3],
                    "generation_token_ids": [4, 5],
                    "generation_log_probs": [-0.1, -0.2],
                },
                {"type": "function_call_output", "output": "42"},
                {
                    "type": "message",
                    "prompt_token_ids": [1, 2, 3, 4, 5, 6, 7],
                    "generation_token_ids": [8],
                    "generation_log_probs": list(second_logprobs),
                },
            ]
        },
    }


def _postprocessed(result, on_malformed_result="raise"):
    config = NemoGymPostprocessConfig(on_malformed_result=on_malformed_result)
    return postprocess_gym_result(ROW, result, config)


def test_from_postprocessed_flattens_turns_with_generated_tokens_masked_in():
    trajectory = Trajectory.from_postprocessed(
        _postprocessed(_result(reward=0.5)), group_id="calc_agent/task-7", weight_version=3
    )
    assert trajectory.token_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert trajectory.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert trajectory.generation_logprobs == [0.0, 0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3]
    assert trajectory.reward == 0.5
    assert trajectory.agent == "calc_agent"
    assert trajectory.group_id == "calc_agent/task-7"
    assert trajectory.weight_version == 3
    assert trajectory.num_generated_tokens == 3
    assert not trajectory.is_masked


def test_masked_malformed_sample_has_no_tokens_but_keeps_its_reward():
    # One log-probability for a generation of one token is fine; two for one token is malformed.
    malformed = _result(reward=0.25, second_logprobs=(-0.3, -0.4))
    trajectory = Trajectory.from_postprocessed(
        _postprocessed(malformed, on_malformed_result="mask"), group_id="g", weight_version=0
    )
    assert trajectory.is_masked
    assert trajectory.token_ids == [] and trajectory.num_generated_tokens == 0
    assert trajectory.reward == 0.25


def test_overlong_flag_is_carried():
    out = _postprocessed({**_result(), "overlong": True})
    assert Trajectory.from_postprocessed(out, group_id="g", weight_version=0).overlong


def test_missing_agent_and_unknown_role_are_clear_errors():
    out = _postprocessed(_result())
    with pytest.raises(ValueError, match=r"agent_ref\.name"):
        Trajectory.from_postprocessed(
            replace(out, result={"reward": 1.0}), group_id="g", weight_version=0
        )
    out = replace(out, message_log=[{"role": "tool", "token_ids": [1]}])
    with pytest.raises(ValueError, match=r"message_log\[0\]\.role is 'tool'"):
        Trajectory.from_postprocessed(out, group_id="g", weight_version=0)


def test_a_trajectory_cannot_start_with_a_generated_token():
    with pytest.raises(ValueError, match="starts with a generated token"):
        Trajectory([5], [1], [-0.1], 1.0, "a", "g", 0)


def _trajectory(token_ids, loss_mask, logprobs, group_id="g"):
    return Trajectory(token_ids, loss_mask, logprobs, 1.0, "a", group_id, 0)


def test_collate_right_pads_keeps_alignment_and_drops_masked_samples():
    long = _trajectory([1, 2, 3, 4], [0, 0, 1, 1], [0.0, 0.0, -0.5, -0.25])
    masked = _trajectory([], [], [])
    short = _trajectory([7, 8], [0, 1], [0.0, -1.0])
    batch = collate(
        [long, masked, short], advantages=torch.tensor([1.0, 9.0, -2.0]), pad_token_id=0
    )
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4], [7, 8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]
    assert batch["generation_logprobs"].tolist() == [[0.0, 0.0, -0.5, -0.25], [0.0, -1.0, 0, 0]]
    assert batch["advantages"].tolist() == [1.0, -2.0]
    assert batch["generation_logprobs"].dtype == torch.float32


def test_collate_pads_to_max_length_and_refuses_longer_trajectories():
    short = _trajectory([7, 8], [0, 1], [0.0, -1.0])
    batch = collate([short], advantages=torch.tensor([0.5]), pad_token_id=99, max_length=4)
    assert batch["input_ids"].tolist() == [[7, 8, 99, 99]]
    too_long = _trajectory([1, 2, 3, 4, 5], [0, 0, 1, 1, 1], [0.0, 0.0, -1.0, -1.0, -1.0], "big")
    with pytest.raises(ValueError, match=r"group 'big'.*5 tokens, more than max_length=4"):
        collate([short, too_long], advantages=torch.zeros(2), pad_token_id=0, max_length=4)


def test_collate_checks_advantages_shape():
    with pytest.raises(ValueError, match=r"advantages must have shape \[1\]"):
        collate(
            [_trajectory([1, 2], [0, 1], [0.0, -1.0])], advantages=torch.zeros(2), pad_token_id=0
        )


def test_collate_of_only_masked_samples_is_an_empty_batch():
    batch = collate([_trajectory([], [], [])], advantages=torch.tensor([3.0]), pad_token_id=0)
    assert batch["input_ids"].shape == (0, 0) and batch["advantages"].shape == (0,)


def test_each_model_calls_end_is_kept_for_its_routes():
    """Router replay assembles an episode's routes from each call's sequence: the prefix up to
    the call's last generated token."""
    trajectory = Trajectory.from_postprocessed(
        _postprocessed(_result()), group_id="g", weight_version=0
    )
    assert trajectory.call_ends == (5, 8)  # [1, 2, 3] -> [4, 5]; [.., 6, 7] -> [8]
    assert trajectory.route_coverage() == (0, 7)
    routes = np.zeros((8, 2, 1), np.uint8)
    routes[2] = 255
    routed = replace(trajectory, routed_experts=routes)
    assert routed.route_coverage() == (6, 7)
    with pytest.raises(ValueError, match=r"must be \[8 tokens, layers, top-k\]"):
        replace(trajectory, routed_experts=routes[:7])

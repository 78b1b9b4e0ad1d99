"""One meaning of "the episode" for every rule, under truncation and split mode
(docs/configuration.md, "What the episode is"): everything the model generated in it, whether
trained on as the prefix, kept as a tail segment, or dropped; and for an episode whose agent
declared its compactions, one episode however many segments it is trained as.

A real postprocessed result goes through the trajectory and the episode rules as a run takes
it: the soft overlong penalty sees the episode's longest call wherever it lies; a group whose
failed episodes count with a reward keeps a lone survivor; the loss options that would weigh a
split episode once per segment are refused with split mode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gymrl.algo.episode_rules import EpisodeRules
from gymrl.algo.trajectory import Trajectory
from gymrl.config.compose import compose_raw
from gymrl.config.schema.loss import EpisodeRulesConfig, LossConfig
from gymrl.preflight.validate import validate_config
from nemo_gym_ext.config import NemoGymPostprocessConfig
from nemo_gym_ext.config_errors import ConfigError
from nemo_gym_ext.postprocess import postprocess_gym_result
from tests.support.metric_docs import documented_keys

LIMIT = 16
ROW = {"id": "r0", "agent_ref": {"type": "responses_api_agents", "name": "calc"}}


def _item(prompt, generation):
    return {
        "type": "message",
        "role": "assistant",
        "content": [],
        "prompt_token_ids": prompt,
        "generation_token_ids": generation,
        "generation_log_probs": [-0.5] * len(generation),
    }


def _result(long_call_at: int) -> dict:
    """Three model calls; the third call's prompt re-renders the second answer (a divergence),
    so truncation keeps the first two calls. The call `long_call_at` generates 15 tokens, one
    short of the limit; the others 2."""
    sizes = [15 if call == long_call_at else 2 for call in range(3)]
    first = [1, 2, 3]
    gen0 = list(range(100, 100 + sizes[0]))
    second = [*first, *gen0, 4]
    gen1 = list(range(200, 200 + sizes[1]))
    third = [*first, *gen0, 4, 999, 5]  # the second answer re-encoded: diverged
    gen2 = list(range(300, 300 + sizes[2]))
    output = [_item(first, gen0), _item(second, gen1), _item(third, gen2)]
    return {**ROW, "response": {"output": output}, "reward": 1.0}


@pytest.mark.parametrize("split", [0, 1], ids=["truncate", "split"])
@pytest.mark.parametrize("long_call_at", [0, 2], ids=["kept", "after_the_divergence"])
def test_the_overlong_penalty_sees_the_episodes_longest_call_wherever_it_lies(split, long_call_at):
    config = NemoGymPostprocessConfig(
        truncate_noncontiguous_episodes=True, split_noncontiguous_segments=split
    )
    out = postprocess_gym_result(ROW, _result(long_call_at), config)
    assert out.full_result["noncontiguous_truncated"] is True
    assert out.full_result["longest_call_tokens"] == 15
    assert "train/<agent>/longest_call_tokens/<red>" in documented_keys()
    rules = EpisodeRules(
        LossConfig(episodes=EpisodeRulesConfig(overlong_penalty_buffer_tokens=4)), LIMIT
    )
    head = rules.shape(Trajectory.from_postprocessed(out, group_id="g", weight_version=0))
    segments = [
        rules.shape(s)
        for s in Trajectory.segments_from_postprocessed(out, group_id="g", weight_version=0)
    ]
    assert len(segments) == split
    # 15 of 16 tokens with a 4-token buffer: three quarters of the maximum penalty.
    assert head.length_penalty == pytest.approx(0.75)
    assert [s.length_penalty for s in segments] == [pytest.approx(0.75)] * split


SPLIT = [
    "env.nemo_gym.truncate_noncontiguous_episodes=true",
    "env.nemo_gym.split_noncontiguous_segments=2",
]


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("loss.token_level_normalization=false", "loss.token_level_normalization"),
        ("loss.off_policy_correction.mode=sequence_mask", "loss.off_policy_correction.mode"),
        ("loss.off_policy_correction.mode=sequence_truncate", "loss.off_policy_correction.mode"),
    ],
)
def test_split_mode_refuses_loss_options_that_would_weigh_an_episode_per_segment(override, key):
    with pytest.raises(ConfigError) as raised:
        validate_config(compose_raw([*SPLIT, override]))
    (issue,) = [issue for issue in raised.value.issues if issue.key == key]
    assert "env.nemo_gym.split_noncontiguous_segments=2" in issue.problem
    assert "once per segment" in issue.problem
    validate_config(compose_raw(SPLIT))  # the token-level defaults see each token once
    validate_config(compose_raw([override]))  # and without split mode a sequence is an episode


COMPACTED = Path(__file__).resolve().parents[2] / "data" / "compaction" / "episodes.json"


def _compacted_group() -> list[Trajectory]:
    """Gym's two compacted episodes (three declared segments each) as one group, with rewards
    1 and 0: each episode's trajectory, then its segments, as the producer builds a group."""
    trajectories = []
    for reward, result in zip((1.0, 0.0), json.loads(COMPACTED.read_text()).values(), strict=True):
        result = {**result, "reward": reward}
        row = {"id": result["id"], "agent_ref": result["agent_ref"]}
        out = postprocess_gym_result(row, result, NemoGymPostprocessConfig())
        trajectories.append(Trajectory.from_postprocessed(out, group_id="g", weight_version=0))
        trajectories += Trajectory.segments_from_postprocessed(out, group_id="g", weight_version=0)
    return trajectories


def test_a_compacted_episode_counts_once_in_its_baseline_and_each_segment_shares_its_advantage():
    group = _compacted_group()
    assert [t.segment for t in group] == [0, 1, 2, 0, 1, 2]
    rules = EpisodeRules(LossConfig(), default_limit_tokens=LIMIT)
    advantages = rules.advantages(group, {}).tolist()
    # Two episodes, rewards 1 and 0: the baseline is their mean, whatever the segment counts.
    alone = rules.advantages([group[0], group[3]], {}).tolist()
    assert advantages == [alone[0]] * 3 + [alone[1]] * 3
    assert alone[0] == pytest.approx(-alone[1]) and alone[0] > 0


def test_no_sampled_token_of_a_compacted_episode_is_trained_twice():
    group = _compacted_group()
    results = json.loads(COMPACTED.read_text()).values()
    sampled = [
        len(item["generation_token_ids"])
        for result in results
        for item in result["response"]["output"]
        if "generation_token_ids" in item
    ]
    assert sum(t.num_generated_tokens for t in group) == sum(sampled)
    assert sum(sum(t.loss_mask) for t in group) == sum(sampled)

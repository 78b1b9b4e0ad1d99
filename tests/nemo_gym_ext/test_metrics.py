"""Tests of `per_agent_metrics`: the per-agent scalars the trainer logs (keys in docs/metrics.md).

`<agent>/noncontiguous_truncated/mean` is the truncation rate the PR surfaces; these tests pin
its exact name, its value over mixed batches in any order, and that stale flags on reused
result dicts do not leak into it.
"""

from __future__ import annotations

import math
import random

import pytest

from nemo_gym_ext.config import NemoGymPostprocessConfig
from nemo_gym_ext.metrics import per_agent_metrics
from nemo_gym_ext.postprocess import postprocess_gym_result

TRUNCATE = NemoGymPostprocessConfig(truncate_noncontiguous_episodes=True)


def _result(agent: str, **fields):
    return {"agent_ref": {"type": "responses_api_agents", "name": agent}, **fields}


MIXED_BATCH = [
    _result("swe", reward=1.0, noncontiguous_truncated=True),
    _result("math", reward=0.0, noncontiguous_truncated=False),
    _result("swe", reward=0.0, noncontiguous_truncated=False),
    _result("swe", reward=0.5, noncontiguous_truncated=False),
    _result("math", reward=1.0, noncontiguous_truncated=True),
    _result("swe", reward=0.5, noncontiguous_truncated=True),
]
MIXED_EXPECTED = {
    "math/noncontiguous_truncated/max": 1.0,
    "math/noncontiguous_truncated/mean": 0.5,
    "math/noncontiguous_truncated/min": 0.0,
    "math/reward/max": 1.0,
    "math/reward/mean": 0.5,
    "math/reward/min": 0.0,
    "swe/noncontiguous_truncated/max": 1.0,
    "swe/noncontiguous_truncated/mean": 0.5,
    "swe/noncontiguous_truncated/min": 0.0,
    "swe/reward/max": 1.0,
    "swe/reward/mean": 0.5,
    "swe/reward/min": 0.0,
}


def test_mixed_batch_of_two_agents_gives_exact_names_and_values():
    metrics = per_agent_metrics(MIXED_BATCH)
    assert metrics == MIXED_EXPECTED
    assert all(type(value) is float for value in metrics.values())


@pytest.mark.parametrize("seed", range(6))
def test_batch_order_does_not_matter(seed):
    batch = list(MIXED_BATCH)
    random.Random(seed).shuffle(batch)
    assert per_agent_metrics(batch) == MIXED_EXPECTED


def test_agents_in_blocks_and_interleaved_agree():
    by_agent = sorted(MIXED_BATCH, key=lambda result: result["agent_ref"]["name"])
    assert per_agent_metrics(by_agent) == per_agent_metrics(MIXED_BATCH[::-1])


def test_truncation_rate_is_the_share_of_truncated_episodes():
    batch = [_result("swe", noncontiguous_truncated=index < 3) for index in range(8)]
    batch += [_result("math", noncontiguous_truncated=False) for _ in range(5)]
    metrics = per_agent_metrics(batch)
    assert metrics["swe/noncontiguous_truncated/mean"] == 3 / 8
    assert metrics["math/noncontiguous_truncated/mean"] == 0.0
    assert metrics["math/noncontiguous_truncated/max"] == 0.0


def test_a_result_lacking_a_field_does_not_count_towards_it():
    metrics = per_agent_metrics(
        [
            _result("swe", reward=1.0, tests_passed=4),
            _result("swe", reward=0.0),
            _result("swe", reward=0.5, tests_passed=2),
        ]
    )
    assert metrics["swe/reward/mean"] == 0.5
    assert metrics["swe/tests_passed/mean"] == 3.0
    assert (metrics["swe/tests_passed/min"], metrics["swe/tests_passed/max"]) == (2.0, 4.0)


def test_non_numeric_and_non_finite_fields_are_ignored():
    metrics = per_agent_metrics(
        [
            _result(
                "swe",
                reward=1.0,
                instance_id="django-11099",
                response={"output": []},
                tags=["a"],
                note=None,
                score=math.nan,
                bonus=math.inf,
            ),
            _result("swe", reward=0.0, score=0.25),
        ]
    )
    assert set(metrics) == {
        "swe/reward/mean",
        "swe/reward/min",
        "swe/reward/max",
        "swe/score/mean",
        "swe/score/min",
        "swe/score/max",
    }
    assert metrics["swe/score/mean"] == 0.25


def test_booleans_count_as_zero_and_one():
    metrics = per_agent_metrics(
        [_result("a", overlong=True), _result("a", overlong=False), _result("a", overlong=False)]
    )
    assert metrics["a/overlong/mean"] == pytest.approx(1 / 3)
    assert (metrics["a/overlong/min"], metrics["a/overlong/max"]) == (0.0, 1.0)


def test_empty_batch_gives_no_metrics():
    assert per_agent_metrics([]) == {}


@pytest.mark.parametrize(
    "result",
    [
        {"reward": 1.0},
        {"agent_ref": None, "reward": 1.0},
        {"agent_ref": {"type": "x"}, "reward": 0.0},
    ],
    ids=["no-agent-ref", "agent-ref-none", "agent-ref-without-name"],
)
def test_result_without_agent_name_raises_a_clear_error(result):
    batch = [_result("swe", reward=1.0), result]
    with pytest.raises(ValueError, match=r"agent_ref\.name") as caught:
        per_agent_metrics(batch)
    assert "reward" in str(caught.value)


def test_postprocessed_batch_has_exactly_the_documented_keys(episode_builder, turn_maker):
    """Only the numeric top-level fields of a full_result become metrics; nested ones do not."""
    episode = episode_builder(turn_maker(21, 3), agent="swe", reward=1.0)
    full = postprocess_gym_result(episode.row, episode.result, TRUNCATE).full_result
    fields = (
        "reward",
        "noncontiguous_truncated",
        "noncontiguous_dropped_turns",
        "malformed_sample",
        "trainable_turns",
        "generated_tokens",
        "longest_call_tokens",
        "overlong",
    )
    reductions = ("mean", "min", "max")
    assert set(per_agent_metrics([full])) == {
        f"swe/{field}/{reduction}" for field in fields for reduction in reductions
    }


def test_stale_flags_on_reused_dicts_do_not_leak_into_the_truncation_rate(
    episode_builder, divergence_at, turn_maker
):
    """Reused result dicts carry `noncontiguous_truncated: True` from an earlier step; after
    postprocessing, the rate counts only the episodes truncated now."""
    stale = {"noncontiguous_truncated": True, "noncontiguous_dropped_turns": 4}
    plan = [
        ("swe", None),
        ("swe", 2),
        ("swe", None),
        ("swe", None),
        ("math", 1),
        ("math", None),
        ("math", 3),
    ]
    full_results = []
    for index, (agent, divergent_turn) in enumerate(plan):
        episode = episode_builder(
            turn_maker(100 + index, 4),
            divergence=None if divergent_turn is None else divergence_at(divergent_turn),
            agent=agent,
            row_id=f"{agent}-{index}",
            reward=float(index % 2),
            result_fields=stale,
        )
        full_results.append(
            postprocess_gym_result(episode.row, episode.result, TRUNCATE).full_result
        )
    random.Random(0).shuffle(full_results)
    metrics = per_agent_metrics(full_results)
    assert metrics["swe/noncontiguous_truncated/mean"] == 1 / 4
    assert metrics["math/noncontiguous_truncated/mean"] == 2 / 3
    assert metrics["swe/noncontiguous_dropped_turns/mean"] == 2 / 4
    assert metrics["math/noncontiguous_dropped_turns/mean"] == (3 + 1) / 3
    assert metrics["swe/reward/mean"] == 0.5
    assert metrics["math/reward/mean"] == pytest.approx(1 / 3)

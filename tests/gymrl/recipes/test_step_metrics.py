"""`gymrl.recipes.step_metrics`, the keys a step logs, by name, against docs/metrics.md: issue 21's
per-agent trainer-engine figures, the infrastructure failure rate, dynamic sampling's counts, the
overlong summary fields (computed from real trainer metrics and real producer counts, no Ray);
issue 22's response lengths and clipped shares; and the engine's figures over a step's window."""

import dataclasses
import math

import numpy as np
import torch

from gymrl.algo.loss import grpo_loss
from gymrl.algo.trajectory import Trajectory
from gymrl.config.schema.loss import OffPolicyCorrectionConfig
from gymrl.experience.producer import ProducerCounts
from gymrl.experience.rollout_group import RolloutGroup
from gymrl.generation.server.divergence_watch import DivergenceCounts
from gymrl.generation.server.route_store import RouteStoreCounts
from gymrl.generation.server.sampling_rules import SamplingCounts
from gymrl.generation.torch.engine import EngineCounters
from gymrl.recipes.step_metrics import (
    EngineSnapshot,
    engine_metrics,
    router_replay_metrics,
    step_metrics,
)
from tests.support.metric_docs import documented_patterns


def _group(agent: str, rewards: list[float], failed: int) -> RolloutGroup:
    trajectories = [
        Trajectory([1, 2, 3], [0, 1, 1], [0.0, -0.5, -0.7], r, agent, f"{agent}-g", 0)
        for r in rewards
    ]
    return _group_of(trajectories, failed)


def _group_of(trajectories: list[Trajectory], failed: int = 0) -> RolloutGroup:
    agent = trajectories[0].agent
    summaries = [
        {
            "agent_ref": {"name": agent},
            "reward": t.reward,
            "length_penalty": 0.0,
            "overlong_masked": False,
        }
        for t in trajectories
    ]
    return RolloutGroup.of(trajectories, summaries, seconds=1.0, failed_episodes=failed)


def test_a_steps_new_keys_are_logged_and_documented():
    logprobs = torch.tensor([[0.0, -0.4, -0.7], [0.0, -0.5, -2.0]])
    _, train_metrics = grpo_loss(
        logprobs,
        torch.tensor([[0.0, -0.5, -0.7], [0.0, -0.5, -0.7]]),
        torch.tensor([1.0, -1.0]),
        torch.tensor([[0, 1, 1], [0, 1, 1]]),
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        kl_coef=0.0,
        off_policy=OffPolicyCorrectionConfig(mode="token_mask"),
        token_level_normalization=True,
        agents=["calc", "guess"],
    )
    groups = [_group("calc", [1.0, 0.0], failed=2), _group("guess", [0.5, 0.5], failed=0)]
    counts = ProducerCounts(0, 0, 2, uniform_dropped={"guess": 3}, uniform_over_budget=1)
    metrics = step_metrics(0, groups, train_metrics, counts, max_tokens_per_turn=64)
    assert metrics["train/calc/infra_failure_rate"] == 0.5
    assert metrics["train/guess/infra_failure_rate"] == 0.0
    assert metrics["train/guess/off_policy/masked_share"] == 0.5  # ratio e^-1.3 left the band
    assert metrics["train/calc/off_policy/logprob_diff/max"] > 0
    for key in ("ratio/mean", "ratio/std", "ratio/min", "ratio/max", "logprob_diff/mean"):
        assert f"train/calc/off_policy/{key}" in metrics
    assert metrics["train/calc/off_policy/capped_share"] == 0.0
    assert metrics["rollout/guess/uniform_dropped_total"] == 3.0
    assert metrics["rollout/uniform_over_budget_total"] == 1.0
    assert "train/calc/length_penalty/mean" in metrics
    assert "train/calc/overlong_masked/max" in metrics
    assert not [k for k in metrics if k.startswith("train/by_agent/")]  # totals stay internal
    # trainer - engine per generated token: 0.1, 0, 0, -1.3; only -1.3 is beyond ln 2.
    deltas = torch.tensor([0.1, 0.0, 0.0, -1.3])
    expected_k3 = float((deltas.exp() - 1 - deltas).mean())
    assert math.isclose(metrics["train/mismatch/k3_kl"], expected_k3, rel_tol=1e-6)
    assert metrics["train/mismatch/large_delta_share"] == 0.25
    patterns = documented_patterns()
    undocumented = [k for k in metrics if not any(p.match(k) for p in patterns)]
    assert undocumented == []
    assert any(p.match("parity/passed") for p in patterns)


def _episode(turns: list[int], *, overlong: bool = False) -> Trajectory:
    """An episode of one prompt token then, per model call, a user token and `turns[i]`
    generated tokens."""
    mask = [0]
    for length in turns:
        mask += [0] + [1] * length
    return Trajectory(
        [5] * len(mask),
        mask,
        [0.0] * len(mask),
        1.0,
        "calc",
        "calc-g",
        0,
        overlong=overlong,
        turn_lengths=tuple(turns),
    )


def test_response_lengths_and_clipped_shares_are_logged_and_documented():
    """Three episodes: two calls (10 and the whole 64-token limit, flagged overlong), one
    call of 6, and one masked for hitting a limit (no tokens left, still clipped)."""
    masked = Trajectory([], [], [], 0.0, "calc", "calc-g", 0, overlong=True)
    group = _group_of([_episode([10, 64], overlong=True), _episode([6]), masked])
    metrics = step_metrics(0, [group], {}, ProducerCounts(0, 0, 0), max_tokens_per_turn=64)
    lengths = {k: v for k, v in metrics.items() if "generated_tokens/" in k}
    assert lengths == {
        "rollout/episode_generated_tokens/mean": 40.0,
        "rollout/episode_generated_tokens/min": 6.0,
        "rollout/episode_generated_tokens/max": 74.0,
        "rollout/turn_generated_tokens/mean": 80 / 3,
        "rollout/turn_generated_tokens/min": 6.0,
        "rollout/turn_generated_tokens/max": 64.0,
    }
    assert metrics["rollout/clipped_episode_share"] == 2 / 3
    assert metrics["rollout/clipped_turn_share"] == 1 / 3
    patterns = documented_patterns()
    assert [k for k in metrics if not any(p.match(k) for p in patterns)] == []


def test_the_engines_figures_are_the_windows_differences_and_documented():
    """A 2 s window: 1 s busy, 3 decode steps of 2, 4 and 6 rows, 30 tokens generated, 20 of 80
    prompt tokens from the prefix cache; one request overridden, one found diverged."""
    seen = EngineSnapshot(
        10.0,
        EngineCounters(busy_s=5.0, decode_steps=7, decode_rows=9, prefill_tokens=100),
        SamplingCounts(overridden=1),
        DivergenceCounts(detected=2, stopped=1, unchecked=4),
    )
    now = EngineSnapshot(
        12.0,
        EngineCounters(
            busy_s=6.0,
            decode_steps=10,
            decode_rows=21,
            prefill_tokens=160,
            reused_tokens=20,
            generated_tokens=30,
        ),
        SamplingCounts(overridden=2),
        DivergenceCounts(detected=3, stopped=1, unchecked=6),
    )
    metrics = engine_metrics(seen, now)
    assert metrics == {
        "generation/divergence_detected": 1.0,
        "generation/divergence_stopped": 0.0,
        "generation/divergence_unchecked": 2.0,
        "generation/sampling_overridden": 1.0,
        "generation/sampling_rejected": 0.0,
        "perf/engine_busy_share": 0.5,
        "perf/engine_rows_per_decode_step": 4.0,
        "perf/engine_tokens_per_busy_s": 30.0,
        "perf/engine_prefix_reuse_share": 0.25,
        "perf/generated_tokens_per_s": 15.0,
    }
    patterns = documented_patterns()
    assert [k for k in metrics if not any(p.match(k) for p in patterns)] == []


def test_an_idle_window_gives_nan_ratios_and_sglang_engines_no_perf_keys():
    counters = EngineCounters(busy_s=1.0, decode_steps=2)
    idle = engine_metrics(
        EngineSnapshot(0.0, counters, SamplingCounts(), DivergenceCounts()),
        EngineSnapshot(1.0, counters, SamplingCounts(), DivergenceCounts()),
    )
    assert idle["perf/engine_busy_share"] == 0.0
    for key in ("rows_per_decode_step", "tokens_per_busy_s", "prefix_reuse_share"):
        assert math.isnan(idle[f"perf/engine_{key}"])
    sglang = engine_metrics(
        EngineSnapshot(0.0, None, SamplingCounts(), DivergenceCounts()),
        EngineSnapshot(1.0, None, SamplingCounts(rejected=1), DivergenceCounts()),
    )
    assert sglang["generation/sampling_rejected"] == 1.0
    assert not [k for k in sglang if k.startswith("perf/")]


def test_router_replay_figures_count_the_positions_that_need_routes():
    """Positions but each sequence's last need routes; those at the missing id (255) fell back
    to the live router. Masked samples hold no tokens and need none."""
    routed = np.full((7, 2, 2), 3, np.uint8)
    routed[1] = routed[6] = 255  # one position lost, and the last token (never counted)
    first = dataclasses.replace(_episode([2, 2]), routed_experts=routed)
    second = dataclasses.replace(_episode([1, 1]), routed_experts=np.full((5, 2, 2), 255, np.uint8))
    masked = Trajectory([], [], [], 0.0, "calc", "calc-g", 0)
    held = RouteStoreCounts(held_calls=2, held_bytes=3 << 20, evicted_calls=4)
    metrics = router_replay_metrics([first, second, masked], held)
    assert metrics == {
        "router_replay/route_rows_expected": 10.0,
        "router_replay/route_rows_received": 5.0,
        "router_replay/fallback_token_share": 0.5,
        "router_replay/bytes_per_token": 4.0,
        "router_replay/held_mib": 3.0,
        "router_replay/evicted_calls": 4.0,
    }
    patterns = documented_patterns()
    assert [k for k in metrics if not any(p.match(k) for p in patterns)] == []

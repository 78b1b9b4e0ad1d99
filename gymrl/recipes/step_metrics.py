"""The arithmetic of a training step's record: what the step's groups, the trainer's report, the
producer's totals and the engine's counters come to under the keys of docs/metrics.md.

Pure functions of plain values (no Ray, no clock), so each key can be checked directly
(tests/gymrl/recipes/test_step_metrics.py); the recipe only gathers the inputs. The keys are an
API: dashboards, sweeps' objectives and the smoke tests read them by name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gymrl.algo.advantages import share_of_groups_with_variance
from gymrl.algo.trajectory import Trajectory
from gymrl.experience.producer import ProducerCounts
from gymrl.experience.rollout_group import RolloutGroup
from gymrl.generation.server.divergence_watch import DivergenceCounts
from gymrl.generation.server.route_store import RouteStoreCounts
from gymrl.generation.server.sampling_rules import SamplingCounts
from gymrl.generation.torch.engine import EngineCounters
from gymrl.trainer.grpo_step import agent_off_policy_metrics
from nemo_gym_ext.metrics import per_agent_metrics


@dataclass(frozen=True)
class EngineSnapshot:
    """The generation server's totals at one moment (`time.monotonic()`): the torch engine's
    counters (None for SGLang engines), the requests whose sampling was not the run's and the
    requests it found diverged."""

    seconds: float
    engine: EngineCounters | None
    sampling: SamplingCounts
    divergence: DivergenceCounts


def step_metrics(
    step: int,
    groups: Sequence[RolloutGroup],
    train_metrics: Mapping[str, float],
    counts: ProducerCounts,
    max_tokens_per_turn: int,
) -> dict[str, float]:
    """The `train/`, `rollout/` and `async/` keys of step `step` (0-based) trained on `groups`,
    from the trainer's `train_metrics` and the producer's running `counts`."""
    trajectories: list[Trajectory] = [t for group in groups for t in group.trajectories]
    episodes = [t for group in groups for t in group.episodes]  # tail segments left out
    results = [summary for group in groups for summary in group.summaries]
    ages = [step - t.weight_version for t in trajectories]
    generated = sum(t.num_generated_tokens for t in trajectories)
    own, off_policy = agent_off_policy_metrics(train_metrics)
    metrics: dict[str, float] = {f"train/{k}": v for k, v in own.items()}
    metrics.update({f"train/{k}": v for k, v in per_agent_metrics(results).items()})
    metrics.update({f"train/{k}": v for k, v in off_policy.items()})
    metrics.update({f"train/{k}": v for k, v in _infra_failure_rates(groups).items()})
    metrics.update(_response_lengths(trajectories, max_tokens_per_turn))
    metrics.update(
        {
            f"rollout/{agent}/uniform_dropped_total": float(count)
            for agent, count in counts.uniform_dropped.items()
        }
    )
    metrics.update(
        {
            "train/reward/mean": float(sum(t.reward for t in episodes) / len(episodes)),
            "train/groups_with_reward_variance": share_of_groups_with_variance(
                [t.reward for t in episodes], [t.group_id for t in episodes]
            ),
            "rollout/episodes": float(len(episodes)),
            "rollout/generated_tokens": float(generated),
            "rollout/failures_total": float(counts.failures),
            "rollout/prompt_too_long_total": float(counts.prompts_too_long),
            "rollout/episode_timeouts_total": float(counts.episode_timeouts),
            "rollout/retries_total": float(counts.retries),
            "rollout/dropped_groups_total": float(counts.dropped_groups),
            "rollout/uniform_over_budget_total": float(counts.uniform_over_budget),
            "rollout/group_s/mean": _mean([group.seconds for group in groups]),
            "async/weight_version": float(step + 1),
            "async/trajectory_age/mean": _mean(ages),
            "async/trajectory_age/max": float(max(ages)),
        }
    )
    return metrics


def engine_metrics(seen: EngineSnapshot, now: EngineSnapshot) -> dict[str, float]:
    """How the engine spent the time between two snapshots (a step's window), the requests whose
    sampling was not the run's and those found diverged in it; the `perf/engine_*` keys only for
    the torch engine, whose counters the server holds."""
    divergence, diverged_before = now.divergence, seen.divergence
    metrics = {
        "generation/divergence_detected": float(divergence.detected - diverged_before.detected),
        "generation/divergence_stopped": float(divergence.stopped - diverged_before.stopped),
        "generation/divergence_unchecked": float(divergence.unchecked - diverged_before.unchecked),
        "generation/sampling_overridden": float(now.sampling.overridden - seen.sampling.overridden),
        "generation/sampling_rejected": float(now.sampling.rejected - seen.sampling.rejected),
    }
    before, after = seen.engine, now.engine
    if before is None or after is None:
        return metrics
    window_s = now.seconds - seen.seconds
    steps = after.decode_steps - before.decode_steps
    busy = after.busy_s - before.busy_s
    generated = after.generated_tokens - before.generated_tokens
    reused = after.reused_tokens - before.reused_tokens
    prompt_tokens = reused + after.prefill_tokens - before.prefill_tokens
    return metrics | {
        "perf/engine_busy_share": busy / window_s,
        "perf/engine_rows_per_decode_step": (
            (after.decode_rows - before.decode_rows) / steps if steps else math.nan
        ),
        "perf/engine_tokens_per_busy_s": generated / busy if busy else math.nan,
        "perf/engine_prefix_reuse_share": reused / prompt_tokens if prompt_tokens else math.nan,
        "perf/generated_tokens_per_s": generated / window_s,
    }


def router_replay_metrics(
    trajectories: Sequence[Trajectory], held: RouteStoreCounts
) -> dict[str, float]:
    """`router_replay/...` (docs/metrics.md): how many of the step's positions came with the
    engine's routes, and what the policy server's route store holds and dropped."""
    received = expected = 0
    route_bytes = 0
    for trajectory in trajectories:
        if trajectory.is_masked:
            continue
        got, needed = trajectory.route_coverage()
        received += got
        expected += needed
        if trajectory.routed_experts is not None:
            route_bytes += trajectory.routed_experts.nbytes
    tokens = sum(len(t.token_ids) for t in trajectories)
    return {
        "router_replay/route_rows_expected": float(expected),
        "router_replay/route_rows_received": float(received),
        "router_replay/fallback_token_share": 1.0 - received / expected if expected else 0.0,
        "router_replay/bytes_per_token": route_bytes / tokens if tokens else 0.0,
        "router_replay/held_mib": held.held_bytes / 2**20,
        "router_replay/evicted_calls": float(held.evicted_calls),
    }


def _infra_failure_rates(groups: Sequence[RolloutGroup]) -> dict[str, float]:
    """Per agent, `<agent>/infra_failure_rate`: the share of the step's groups' episodes that
    failed after their retries (no result), whatever the baseline does with them."""
    failed: dict[str, int] = {}
    total: dict[str, int] = {}
    for group in groups:
        agent = group.trajectories[0].agent
        failed[agent] = failed.get(agent, 0) + group.failed_episodes
        total[agent] = total.get(agent, 0) + group.failed_episodes + len(group.episodes)
    return {f"{agent}/infra_failure_rate": failed[agent] / total[agent] for agent in total}


def _response_lengths(
    trajectories: Sequence[Trajectory], max_tokens_per_turn: int
) -> dict[str, float]:
    """The response-length and clipped-response figures every peer logs (docs/metrics.md has
    the crosswalk), over the step's episodes: generated tokens per episode and per model call
    trained on, the share of episodes that hit a token limit, and the share of model calls
    trained on that used the policy server's whole `max_tokens_per_turn`. A masked episode (no
    tokens) counts in the episode share only: it has no calls left to measure."""
    episodes = [t.num_generated_tokens for t in trajectories if not t.is_masked]
    turns = [length for t in trajectories for length in t.turn_lengths]
    metrics = {
        "rollout/clipped_episode_share": _mean([float(t.overlong) for t in trajectories]),
        "rollout/clipped_turn_share": _mean(
            [float(length >= max_tokens_per_turn) for length in turns]
        ),
    }
    for name, lengths in (("episode", episodes), ("turn", turns)):
        metrics[f"rollout/{name}_generated_tokens/mean"] = _mean(lengths)
        metrics[f"rollout/{name}_generated_tokens/min"] = float(min(lengths, default=math.nan))
        metrics[f"rollout/{name}_generated_tokens/max"] = float(max(lengths, default=math.nan))
    return metrics


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else math.nan

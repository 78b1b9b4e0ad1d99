"""Validation rollouts: one episode of every held-out row with the current weights, summarised
per agent under `validation/` with the same fields training logs under `train/`.

When (`grpo.val_at_start`, `grpo.val_period`, `grpo.val_at_end`) is the recipe's business; this
module runs one pass. Each row is one group of one episode on the same Gym shards the rollout
producer uses, so a validation episode goes through the same agent, policy server and
postprocessor as a training one (a contiguity error stops the run here too). The pass waits for
every row, with the deadline `grpo.batch_timeout_s`: its figures describe one weight version, so
the trainer does not refit until it is over. In async mode the producer keeps running meanwhile
(its credit allows the next step's groups), so the engine interleaves validation and training
episodes and the next batch is mostly ready when validation ends.

Episodes that still fail after their retries are counted (`validation/failures`), not charged to
the training failure budget, and left out of the means.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gymrl.experience.producer import GroupRunner
from gymrl.experience.rollout_group import scalar_fields
from nemo_gym_ext.metrics import per_agent_metrics
from nemo_gym_ext.wire import agent_name_of

PREFIX = "validation/"
_POLL_S = 0.5


class Validator:
    """Runs every held-out row once through a group runner and summarises the results."""

    def __init__(self, rows: Sequence[dict[str, Any]], runner: GroupRunner, timeout_s: float):
        self._rows = rows
        self._runner = runner
        self._timeout_s = timeout_s

    def run(self) -> dict[str, float]:
        """`validation/...` metrics of one pass over the rows (keys in docs/metrics.md)."""
        deadline = time.monotonic() + self._timeout_s
        pending = [self._runner.submit(agent_name_of(row), row, 1) for row in self._rows]
        results: list[dict[str, Any]] = []
        failures = 0
        try:
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"validation: {len(pending)} of {len(self._rows)} episodes unfinished "
                        f"after grpo.batch_timeout_s={self._timeout_s:g} s; raise it, or lower "
                        "env.data.num_builtin_val_rows_per_agent"
                    )
                for group in self._runner.finished(pending, min(left, _POLL_S)):
                    pending.remove(group)
                    outcome = self._runner.outcome(group)  # contiguity errors propagate
                    failures += len(outcome.failures)
                    results.extend(scalar_fields(e["full_result"]) for e in outcome.episodes)
        finally:
            for group in pending:
                self._runner.cancel(group)
        return validation_metrics(results, failures)


def validation_metrics(results: Sequence[Mapping[str, Any]], failures: int) -> dict[str, float]:
    """Per-agent fields (as training has them), each agent's reward standard error, the mean
    reward over all episodes, and the episode counts."""
    metrics = {PREFIX + key: value for key, value in per_agent_metrics(results).items()}
    for agent, rewards in _rewards_by_agent(results).items():
        metrics[f"{PREFIX}{agent}/reward/stderr"] = standard_error(rewards)
    rewards = [float(r["reward"]) for r in results]
    metrics[PREFIX + "reward/mean"] = math.fsum(rewards) / len(rewards) if rewards else math.nan
    metrics[PREFIX + "episodes"] = float(len(results))
    metrics[PREFIX + "failures"] = float(failures)
    return metrics


def standard_error(values: Sequence[float]) -> float:
    """Sample standard deviation over sqrt(n); NaN below two values."""
    n = len(values)
    if n < 2:
        return math.nan
    mean = math.fsum(values) / n
    variance = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    return math.sqrt(variance / n)


def _rewards_by_agent(results: Iterable[Mapping[str, Any]]) -> dict[str, list[float]]:
    rewards: dict[str, list[float]] = defaultdict(list)
    for result in results:
        rewards[agent_name_of(result)].append(float(result["reward"]))
    return rewards

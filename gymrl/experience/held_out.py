"""Held-out passes: every held-out row, `num_samples` episodes each, with the current weights,
summarised per agent with the same fields training logs under `train/`. Training's validation
(`validation/`, one episode per row) and `recipes/eval.py` (`eval/`, k per row, plus pass@k) are
this one pass and this one reduction, so the two agree on the same rows with the same sampling.

When training validates (`grpo.val_at_start`, `grpo.val_period`, `grpo.val_at_end`) is the
recipe's business; this module runs one pass. Each episode is one group of one episode on the
same Gym shards the rollout producer uses, so a held-out episode goes through the same agent,
policy server and postprocessor as a training one (a contiguity error stops the pass here too).
The pass waits for every episode, with a deadline: its figures describe one weight version, so
the trainer does not refit until it is over. In async mode the producer keeps running meanwhile
(its credit allows the next step's groups), so the engine interleaves validation and training
episodes and the next batch is mostly ready when validation ends.

Episodes that still fail after their retries are counted (`<prefix>failures`), not charged to
the training failure budget, and left out of the means.

A row whose prompt the policy server refuses (longer than its context) has no episode to count:
it is named once in the log, counted (`<prefix>refused_rows`, beside `<prefix>rows`, the rows the
means are over), and the pass fails when every row, or more than
`env.data.max_refused_held_out_share` of them, was refused: a mean over the rows that happen to
fit would be a figure of another data set.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gymrl.experience.producer import GroupRunner
from gymrl.experience.rollout_group import scalar_fields
from nemo_gym_ext.metrics import per_agent_metrics
from nemo_gym_ext.postprocess import (
    OVERLONG_FLAG,
    TRUNCATED_FLAG,
    TURNS_FIELD,
    PostprocessedEpisode,
    row_id_of,
)
from nemo_gym_ext.wire import TOKEN_FIELDS, agent_name_of

PREFIX = "validation/"
_POLL_S = 0.5

log = logging.getLogger(__name__)


class HeldOutRowsRefusedError(ValueError):
    """Too many held-out rows were refused by the policy server for the pass to mean anything."""


@dataclass(frozen=True)
class RefusedRow:
    """A held-out row whose prompt the policy server refused, and why (its first refusal)."""

    row_id: str
    agent: str
    reason: str


@dataclass(frozen=True)
class HeldOutEpisode:
    """One episode of a held-out pass: sample `sample` of row `row_id`. A finished episode has
    its result's agent and numeric fields (`summary`, `scalar_fields`), the tokens of its
    retained turns and the finish reason of each model call where its agent reports them
    (`finish_reasons`, else None); a failed one has only its `failure` cause."""

    row_id: str
    agent: str
    sample: int
    summary: Mapping[str, Any] | None = None
    prompt_tokens: int = 0
    generated_tokens: int = 0
    finish_reasons: tuple[str, ...] | None = None
    transcript: tuple[Mapping[str, Any], ...] | None = None
    failure: str | None = None

    @classmethod
    def finished(
        cls,
        row: Mapping[str, Any],
        sample: int,
        episode: PostprocessedEpisode,
        *,
        keep_transcript: bool = False,
    ) -> HeldOutEpisode:
        """From a postprocessed episode; with `keep_transcript`, its output items without their
        token fields."""
        result = episode.full_result
        total = sum(len(entry["token_ids"]) for entry in episode.message_log)
        reasons = result.get("finish_reasons")
        return cls(
            row_id=row_id_of(row),
            agent=agent_name_of(result),
            sample=sample,
            summary=scalar_fields(result),
            prompt_tokens=total - episode.generated_tokens,
            generated_tokens=episode.generated_tokens,
            finish_reasons=tuple(reasons) if isinstance(reasons, list) else None,
            transcript=_without_tokens(result["response"]["output"]) if keep_transcript else None,
        )

    @property
    def reward(self) -> float:
        assert self.summary is not None, "a failed episode has no reward"
        return float(self.summary["reward"])

    @property
    def truncation_causes(self) -> list[str]:
        """Why the finished episode is not whole: `noncontiguous` (a tail dropped by
        `truncate_noncontiguous_episodes`), `max_tokens` (a reply cut at the token limit)."""
        assert self.summary is not None, "a failed episode has no turns"
        flags = (("noncontiguous", TRUNCATED_FLAG), ("max_tokens", OVERLONG_FLAG))
        return [cause for cause, flag in flags if self.summary.get(flag) is True]

    def record(self) -> dict[str, Any]:
        """The episode as one JSON object of an eval's episodes.jsonl (docs/evaluation.md)."""
        if self.summary is None:
            return {
                "row_id": self.row_id,
                "agent": self.agent,
                "sample": self.sample,
                "failure": self.failure,
            }
        summary, causes = self.summary, self.truncation_causes
        return {
            "row_id": self.row_id,
            "agent": self.agent,
            "sample": self.sample,
            "reward": self.reward,
            # The agent's own count of model calls where it reports one (built-in agents do).
            "turns": summary.get("num_turns", summary[TURNS_FIELD]),
            "trainable_turns": summary[TURNS_FIELD],
            "tokens": {"prompt": self.prompt_tokens, "generated": self.generated_tokens},
            "finish_reasons": None if self.finish_reasons is None else list(self.finish_reasons),
            "truncated": bool(causes),
            "truncation_causes": causes,
            "failure": None,
            **({} if self.transcript is None else {"transcript": list(self.transcript)}),
        }


@dataclass(frozen=True)
class HeldOutPass:
    """What a pass produced: every episode that finished or failed, whether it ran to the end
    (false when `stop` was set: the episodes still running were cancelled), and the rows whose
    prompt the policy server refused (no episode of theirs counts)."""

    episodes: tuple[HeldOutEpisode, ...]
    complete: bool
    refused: tuple[RefusedRow, ...] = ()


class Validator:
    """Runs every held-out row `num_samples` times through a group runner and summarises the
    results under `prefix`. `deadline_key` names the setting the timeout came from;
    `max_refused_share` is `env.data.max_refused_held_out_share`."""

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        runner: GroupRunner,
        timeout_s: float,
        *,
        max_refused_share: float,
        num_samples: int = 1,
        prefix: str = PREFIX,
        deadline_key: str = "grpo.batch_timeout_s",
        keep_transcripts: bool = False,
    ):
        self._rows = rows
        self._runner = runner
        self._timeout_s = timeout_s
        self._num_samples = num_samples
        self._prefix = prefix
        self._deadline_key = deadline_key
        self._keep_transcripts = keep_transcripts
        self._max_refused_share = max_refused_share

    def run(self, on_episode: Callable[[HeldOutEpisode], None] | None = None) -> dict[str, float]:
        """`<prefix>...` metrics of one pass over the rows (keys in docs/metrics.md); each
        episode is handed to `on_episode` as it ends (the recipe's token ledger)."""
        return held_out_metrics(self.collect(on_episode), prefix=self._prefix)

    def collect(
        self,
        on_episode: Callable[[HeldOutEpisode], None] | None = None,
        stop: threading.Event | None = None,
    ) -> HeldOutPass:
        """Every episode of the pass, each handed to `on_episode` as it ends; returns early,
        cancelling what still runs, once `stop` is set. Refused rows are named and checked
        against `max_refused_share` once the pass is complete."""
        deadline = time.monotonic() + self._timeout_s
        pending: dict[Any, tuple[dict[str, Any], int]] = {}
        for row in self._rows:
            for sample in range(self._num_samples):
                pending[self._runner.submit(agent_name_of(row), row, 1)] = (row, sample)
        total, episodes = len(pending), []
        refused: dict[str, RefusedRow] = {}  # by row id: each of its samples is refused alike
        try:
            while pending:
                if stop is not None and stop.is_set():
                    return HeldOutPass(tuple(episodes), False, tuple(refused.values()))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"{self._prefix.rstrip('/')}: {len(pending)} of {total} episodes "
                        f"unfinished after {self._deadline_key}={self._timeout_s:g} s; raise it, "
                        "or evaluate fewer rows (env.data.num_builtin_val_rows_per_agent)"
                    )
                for group in self._runner.finished(list(pending), min(left, _POLL_S)):
                    row, sample = pending.pop(group)
                    outcome = self._runner.outcome(group)  # contiguity errors propagate
                    if outcome.prompt_refused:
                        row_id = row_id_of(row)
                        refused.setdefault(
                            row_id, RefusedRow(row_id, agent_name_of(row), outcome.prompt_refused)
                        )
                    ended = [
                        HeldOutEpisode.finished(
                            row, sample, e, keep_transcript=self._keep_transcripts
                        )
                        for e in outcome.episodes
                    ]
                    ended += [
                        HeldOutEpisode(row_id_of(row), agent_name_of(row), sample, failure=cause)
                        for cause in outcome.failures
                    ]
                    for episode in ended:
                        episodes.append(episode)
                        if on_episode is not None:
                            on_episode(episode)
        finally:
            for group in pending:
                self._runner.cancel(group)
        self._check_refusals(list(refused.values()))
        return HeldOutPass(tuple(episodes), True, tuple(refused.values()))

    def _check_refusals(self, refused: Sequence[RefusedRow]) -> None:
        """Name the refused rows once; fail when all, or more than the allowed share, were."""
        if not refused:
            return
        rows, name = len(self._rows), self._prefix.rstrip("/")
        log.warning(
            f"{name}: the policy server refused the prompt of {len(refused)} of {rows} held-out "
            "rows, left out of the means: "
            + "; ".join(f"{r.row_id} ({r.agent}): {r.reason}" for r in refused)
        )
        share = len(refused) / rows
        if len(refused) == rows or share > self._max_refused_share:
            raise HeldOutRowsRefusedError(
                f"{name}: the policy server refused the prompt of {len(refused)} of {rows} "
                f"held-out rows ({share:.0%}), more than "
                f"env.data.max_refused_held_out_share={self._max_refused_share:g}; the first: "
                f"{refused[0].row_id}: {refused[0].reason}. Shorten those prompts, raise "
                "policy.max_total_sequence_length, or raise the share"
            )


def held_out_metrics(held_out: HeldOutPass, *, prefix: str) -> dict[str, float]:
    """Per-agent fields (as training has them), each agent's reward standard error, the mean
    reward over all finished episodes, the counts of finished and failed episodes, and the rows
    the means are over beside those the policy server refused."""
    episodes = held_out.episodes
    results = [e.summary for e in episodes if e.summary is not None]
    failures = sum(1 for e in episodes if e.failure is not None)
    metrics = {prefix + key: value for key, value in per_agent_metrics(results).items()}
    for agent, rewards in _rewards_by_agent(results).items():
        metrics[f"{prefix}{agent}/reward/stderr"] = standard_error(rewards)
    rewards = [float(r["reward"]) for r in results]
    metrics[prefix + "reward/mean"] = math.fsum(rewards) / len(rewards) if rewards else math.nan
    metrics[prefix + "episodes"] = float(len(results))
    metrics[prefix + "failures"] = float(failures)
    metrics[prefix + "rows"] = float(len({e.row_id for e in episodes}))
    metrics[prefix + "refused_rows"] = float(len(held_out.refused))
    return metrics


def ledger_metrics(episodes: Sequence[HeldOutEpisode], *, prefix: str) -> dict[str, float]:
    """Per agent: finished and failed episodes, the failure rate, the share of finished
    episodes truncated for any cause (a dropped non-contiguous tail, a reply cut at the token
    limit), and the prompt and generated tokens of the retained turns; token totals overall."""
    by_agent: dict[str, list[HeldOutEpisode]] = defaultdict(list)
    for episode in episodes:
        by_agent[episode.agent].append(episode)
    metrics: dict[str, float] = {}
    for agent, own in sorted(by_agent.items()):
        done = [e for e in own if e.failure is None]
        at = f"{prefix}{agent}/"
        metrics[at + "episodes"] = float(len(done))
        metrics[at + "failures"] = float(len(own) - len(done))
        metrics[at + "failure_rate"] = (len(own) - len(done)) / len(own)
        truncated = sum(1 for e in done if e.truncation_causes)
        metrics[at + "truncated/mean"] = truncated / len(done) if done else math.nan
        metrics[at + "tokens/prompt"] = float(sum(e.prompt_tokens for e in done))
        metrics[at + "tokens/generated"] = float(sum(e.generated_tokens for e in done))
    for kind in ("prompt", "generated"):
        totals = (v for k, v in metrics.items() if k.endswith(f"/tokens/{kind}"))
        metrics[f"{prefix}tokens/{kind}"] = float(sum(totals))
    return metrics


def standard_error(values: Sequence[float]) -> float:
    """Sample standard deviation over sqrt(n); NaN below two values."""
    n = len(values)
    if n < 2:
        return math.nan
    mean = math.fsum(values) / n
    variance = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    return math.sqrt(variance / n)


def _without_tokens(items: Iterable[Mapping[str, Any]]) -> tuple[dict[str, Any], ...]:
    return tuple({k: v for k, v in item.items() if k not in TOKEN_FIELDS} for item in items)


def _rewards_by_agent(results: Iterable[Mapping[str, Any]]) -> dict[str, list[float]]:
    rewards: dict[str, list[float]] = defaultdict(list)
    for result in results:
        rewards[agent_name_of(result)].append(float(result["reward"]))
    return rewards

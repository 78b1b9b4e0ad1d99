"""The token ledger: every generated token a step accounts for, trained or not, and if not, why.

Tokens are lost in several places on the way from the engine to an optimizer step, each counted
where it is decided, in generated tokens of trainable turns:

* `dropped_tail`: the tail of a non-contiguous episode that truncation dropped
  (`noncontiguous_dropped_tokens`: with split mode only the turns after its last kept segment),
  whatever then happens to the episode;
* `stale`: episodes of groups the replay buffer evicted as older than
  `grpo.max_trajectory_age_steps` (the buffer's count);
* `failed_or_masked`: episodes masked in a trained group (`on_malformed_result=mask`: their token
  fields are malformed, so they count 0), and the episodes of groups left without a baseline by
  failed siblings (the producer's count). Episodes that failed after their retries have no
  result, so their tokens are not known here;
* `no_variance`: episodes of groups dynamic sampling dropped for teaching nothing (the producer's
  count; with dynamic sampling off such groups are trained on, with advantage 0);
* `overlong_filtered`: episodes that hit a token limit and were masked by
  `loss.episodes.overlong_mask`;
* `validation`: the episodes of validation passes.

A training episode's tail counts as `dropped_tail` first: it was lost at postprocessing, before
the group's fate. A validation episode counts whole as `validation` (it was never for training).
The producer and the buffer keep running totals keyed by (agent, cause); the ledger takes what
they added since the record before, so each record holds that step's tokens and
`generated_tokens = trained_tokens + the untrained causes`, per agent and overall.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gymrl.experience.rollout_group import RolloutGroup
from nemo_gym_ext.postprocess import generated_tokens_of
from nemo_gym_ext.wire import agent_name_of

UNTRAINED_CAUSES = (
    "dropped_tail",
    "stale",
    "failed_or_masked",
    "no_variance",
    "overlong_filtered",
    "validation",
)
PREFIX = "ledger/"


def untrained_episodes(
    agents: Iterable[str], results: Iterable[Mapping[str, Any]], cause: str
) -> Counter[tuple[str, str]]:
    """(agent, cause) -> tokens of episodes lost as a whole for `cause`, their dropped tails
    apart; `results` are postprocessed results or their summaries, `agents` their agents."""
    counts: Counter[tuple[str, str]] = Counter()
    for agent, result in zip(agents, results, strict=True):
        retained, dropped = generated_tokens_of(result)
        counts[(agent, "dropped_tail")] += dropped
        counts[(agent, cause)] += retained
    return +counts  # without the zeros


class TokenLedger:
    """What the recipe's thread accounts between two records; `take` returns it and starts over."""

    def __init__(self) -> None:
        self._trained: Counter[str] = Counter()
        self._untrained: Counter[tuple[str, str]] = Counter()
        self._totals_seen: dict[str, Counter[tuple[str, str]]] = {}

    def trained_groups(self, groups: Sequence[RolloutGroup]) -> None:
        """A step's batch: each episode's trained tokens (its tail segments' too, in split
        mode), its dropped tail, and its kept tokens that a mask kept from the loss."""
        for group in groups:
            trained_by_episode: list[int] = []
            for trajectory in group.trajectories:  # an episode, then its tail segments
                if not trajectory.segment:
                    trained_by_episode.append(0)
                trained_by_episode[-1] += trajectory.num_generated_tokens
            for episode, summary, trained in zip(
                group.episodes, group.summaries, trained_by_episode, strict=True
            ):
                kept, dropped = generated_tokens_of(summary)
                masked = "overlong_filtered" if episode.overlong else "failed_or_masked"
                self._trained[episode.agent] += trained
                self._untrained[(episode.agent, "dropped_tail")] += dropped
                self._untrained[(episode.agent, masked)] += kept - trained

    def validation_pass(self, results: Iterable[Mapping[str, Any]]) -> None:
        """Summaries of a validation pass's finished episodes (all of them, or one at a time)."""
        for result in results:  # a held-out episode's dropped tail is validation's too
            self._untrained[(agent_name_of(result), "validation")] += sum(
                generated_tokens_of(result)
            )

    def running_totals(self, source: str, totals: Mapping[tuple[str, str], int]) -> None:
        """A running (agent, cause) total kept elsewhere (the producer, the buffer): what it
        gained since this source's last call."""
        seen = self._totals_seen.setdefault(source, Counter())
        for key, value in totals.items():
            self._untrained[key] += value - seen[key]
        self._totals_seen[source] = Counter(totals)

    def take(self) -> dict[str, float]:
        """`ledger/...` metrics of what was accounted since the last call (docs/metrics.md):
        per agent that had any tokens, and overall."""
        # `+` keeps the positive counts: an agent appears where it had tokens.
        agents = sorted(set(+self._trained) | {agent for agent, _ in +self._untrained})
        metrics: dict[str, float] = {}
        overall: Counter[str] = Counter()
        for agent in agents:
            at = f"{PREFIX}{agent}/"
            trained = self._trained[agent]
            untrained = {cause: self._untrained[(agent, cause)] for cause in UNTRAINED_CAUSES}
            metrics[at + "generated_tokens"] = float(trained + sum(untrained.values()))
            metrics[at + "trained_tokens"] = float(trained)
            for cause, tokens in untrained.items():
                metrics[f"{at}untrained_tokens/{cause}"] = float(tokens)
            overall.update({"trained": trained, **untrained})
        if agents:
            metrics[PREFIX + "generated_tokens"] = float(sum(overall.values()))
            metrics[PREFIX + "trained_tokens"] = float(overall["trained"])
            for cause in UNTRAINED_CAUSES:
                metrics[f"{PREFIX}untrained_tokens/{cause}"] = float(overall[cause])
        self._trained.clear()
        self._untrained.clear()
        return metrics

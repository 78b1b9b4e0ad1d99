"""pass@k of a held-out pass: the chance that at least one of k episodes of a task succeeds,
estimated without bias from n >= k episodes per task, c of them successes:

    pass@k = 1 - C(n - c, k) / C(n, k)        (1 when n - c < k)

averaged over the tasks (Chen et al. 2021, "Evaluating Large Language Models Trained on Code").
Drawing k of the n episodes at random, C(n - c, k) / C(n, k) is the chance that all k fail;
estimating pass@k from only k episodes per task would be the same in expectation but noisier.
An episode succeeds when its reward is at least the threshold (`eval.success_threshold`). A
task with fewer than k finished episodes (the others failed after their retries) cannot be
scored for that k and is left out of it; `<agent>/pass@<k>/rows` says how many were scored.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

from gymrl.experience.held_out import HeldOutEpisode


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one task with `c` successes among `n` episodes (needs n >= k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    # 1 - prod_{i = n-c+1}^{n} (1 - k / i): the ratio of binomials without large integers.
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_at_k_metrics(
    episodes: Sequence[HeldOutEpisode], ks: Sequence[int], *, threshold: float, prefix: str
) -> dict[str, float]:
    """`<prefix><agent>/pass@<k>` and `/rows` per agent, and `<prefix>pass@<k>` over every
    scored task, for each k, from the finished episodes."""
    tasks: dict[tuple[str, str], list[bool]] = defaultdict(list)
    for episode in episodes:
        if episode.failure is None:
            tasks[(episode.agent, episode.row_id)].append(episode.reward >= threshold)
    metrics: dict[str, float] = {}
    for k in sorted(set(ks)):
        by_agent: dict[str, list[float]] = defaultdict(list)
        for (agent, _), outcomes in sorted(tasks.items()):
            if len(outcomes) >= k:
                by_agent[agent].append(pass_at_k(len(outcomes), sum(outcomes), k))
        for agent, values in by_agent.items():
            metrics[f"{prefix}{agent}/pass@{k}"] = math.fsum(values) / len(values)
            metrics[f"{prefix}{agent}/pass@{k}/rows"] = float(len(values))
        scored = [v for values in by_agent.values() for v in values]
        metrics[f"{prefix}pass@{k}"] = math.fsum(scored) / len(scored) if scored else math.nan
    return metrics

"""Per-agent scalar metrics over a batch of postprocessed Gym results.

For every numeric or boolean top-level field of the results (`reward`, `noncontiguous_truncated`,
any verifier field), each agent gets `<agent>/<field>/mean`, `/min` and `/max`. A result that lacks
a field does not count towards that field; agents are keyed by `agent_ref.name`. So the share of an
agent's episodes that were truncated is `<agent>/noncontiguous_truncated/mean`. The trainer logs
these under `train/`. Every key is documented in docs/metrics.md.

One figure is a ratio of sums, not a mean: `<agent>/compaction_declared_share`, of the
divergences in episodes whose agent declares its compactions (`compactions`), the share it
declared (against `compaction_undeclared_divergences`): a mean of per-episode shares would weigh
an episode with one divergence like one with fifty.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from nemo_gym_ext.postprocess import COMPACTIONS_FIELD, UNDECLARED_FIELD
from nemo_gym_ext.wire import agent_name_of

REDUCTIONS = ("mean", "min", "max")
DECLARED_SHARE = "compaction_declared_share"


def per_agent_metrics(results: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """`{"<agent>/<field>/<mean|min|max>": value}` over `results` (Gym `full_result` dicts)."""
    values: dict[tuple[str, str], list[float]] = defaultdict(list)
    for result in results:
        agent = agent_name_of(result)
        for field, value in result.items():
            number = _scalar(value)
            if number is not None:
                values[(agent, field)].append(number)
    metrics: dict[str, float] = {}
    for (agent, field), numbers in sorted(values.items()):
        prefix = f"{agent}/{field}"
        metrics[f"{prefix}/mean"] = math.fsum(numbers) / len(numbers)
        metrics[f"{prefix}/min"] = min(numbers)
        metrics[f"{prefix}/max"] = max(numbers)
    for agent in sorted({agent for agent, _ in values}):
        declared = math.fsum(values.get((agent, COMPACTIONS_FIELD), ()))
        divergences = declared + math.fsum(values.get((agent, UNDECLARED_FIELD), ()))
        if divergences:
            metrics[f"{agent}/{DECLARED_SHARE}"] = declared / divergences
    return metrics


def _scalar(value: Any) -> float | None:
    """Booleans count as 0/1; non-finite numbers and everything else are not scalar metrics."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    return None

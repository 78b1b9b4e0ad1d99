"""The evaluations section of the offline report: several eval folders (`recipes/eval.py`) side by
side, one column per folder, one block of rows per agent, and a chart per figure (reward with its
standard error, each pass@k) with one bar per folder and agent.

    python -m gymrl.report outputs/learn_seed0/eval/start outputs/learn_seed0/eval/step_12
    python -m gymrl.report outputs/learn_seed0/eval        # every eval folder in it
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from gymrl.run.eval_folder import is_eval_folder, read_summary
from gymrl.tracking.svg import figure_svg

_PREFIX = "eval/"


@dataclass(frozen=True)
class Evaluation:
    """One eval folder's summary (summary.json)."""

    folder: Path
    summary: dict[str, Any]

    @property
    def metrics(self) -> dict[str, float | None]:
        return self.summary["metrics"]

    @property
    def title(self) -> str:
        """`step_12 of learn_seed0` for the default folder (<run>/eval/<label>), else its name."""
        if self.folder.parent.name == "eval":
            return f"{self.summary['label']} of {self.folder.parent.parent.name}"
        return self.folder.name

    def agents(self) -> list[str]:
        ends = "/reward/mean"
        return sorted(
            k[len(_PREFIX) : -len(ends)]
            for k in self.metrics
            if k.endswith(ends) and k.count("/") == 3
        )


def find_evaluations(path: Path) -> list[Evaluation]:
    """`path` itself if it is an eval folder, else every eval folder directly in it."""
    folders = (
        [path] if is_eval_folder(path) else sorted(p for p in path.iterdir() if is_eval_folder(p))
    )
    return [Evaluation(folder, read_summary(folder)) for folder in folders]


def render_evaluations(evaluations: Sequence[Evaluation]) -> str:
    """The section's HTML: the table, then the charts."""
    agents = sorted({agent for e in evaluations for agent in e.agents()})
    ks = sorted({k for e in evaluations for k in e.summary["pass_at_k"]})
    charts = [
        _bars(evaluations, agents, "reward/mean", "reward (mean, s.e. bars)", "reward/stderr")
    ]
    charts += [_bars(evaluations, agents, f"pass@{k}", f"pass@{k}") for k in ks]
    return (
        f"<h2>Evaluations</h2>\n{_table(evaluations, agents, ks)}\n"
        f"<div class='charts'>{''.join(charts)}</div>\n"
    )


def _table(evaluations: Sequence[Evaluation], agents: Sequence[str], ks: Sequence[int]) -> str:
    def row(name: str, cells: Sequence[Any]) -> str:
        tds = "".join(f"<td>{html.escape(str(c))}</td>" for c in cells)
        return f"<tr><th>{html.escape(name)}</th>{tds}</tr>"

    def summary_row(name: str, key: str) -> str:
        return row(name, [e.summary[key] for e in evaluations])

    lines = [
        row("eval", [e.title for e in evaluations]),
        summary_row("step", "step"),
        row("weights", [e.summary["checkpoint"] or "starting (policy.*)" for e in evaluations]),
        summary_row("policy", "policy"),
        row(
            "rows x samples",
            [f"{e.summary['rows']} x {e.summary['num_samples']}" for e in evaluations],
        ),
        summary_row("temperature", "temperature"),
        summary_row("success: reward >=", "success_threshold"),
        summary_row("complete", "complete"),
        row("wall", [f"{e.summary['wall_s']:.0f} s" for e in evaluations]),
    ]
    for agent in agents:
        at = f"{_PREFIX}{agent}/"
        lines.append(
            f"<tr class='agent'><th colspan='{len(evaluations) + 1}'>{html.escape(agent)}</th></tr>"
        )
        lines.append(row("reward", [_mean_and_error(e, at) for e in evaluations]))
        lines += [
            row(f"pass@{k}", [_number(e.metrics.get(f"{at}pass@{k}")) for e in evaluations])
            for k in ks
        ]
        for label, key in (
            ("episodes", "episodes"),
            ("failure rate", "failure_rate"),
            ("truncated", "truncated/mean"),
            ("generated tokens", "tokens/generated"),
        ):
            lines.append(row(label, [_number(e.metrics.get(at + key)) for e in evaluations]))
    return "<div class='wide'><table id='evaluations'>\n" + "\n".join(lines) + "\n</table></div>"


def _bars(
    evaluations: Sequence[Evaluation],
    agents: Sequence[str],
    key: str,
    title: str,
    error_key: str | None = None,
) -> str:
    figure, axis = plt.subplots(figsize=(6.4, 4.0), constrained_layout=True)
    width = 0.8 / max(len(evaluations), 1)
    for number, evaluation in enumerate(evaluations):
        values = [_finite(evaluation.metrics.get(f"{_PREFIX}{a}/{key}")) for a in agents]
        errors = (
            [_finite(evaluation.metrics.get(f"{_PREFIX}{a}/{error_key}")) for a in agents]
            if error_key
            else None
        )
        positions = [i + number * width for i in range(len(agents))]
        axis.bar(positions, values, width, yerr=errors, capsize=3, label=evaluation.title)
    axis.set_xticks([i + width * (len(evaluations) - 1) / 2 for i in range(len(agents))], agents)
    axis.set_ylim(0, 1.05)
    axis.set_title(title)
    axis.legend(fontsize="small")
    return f"<figure class='chart' data-key='{html.escape(key)}'>{figure_svg(figure)}</figure>"


def _mean_and_error(evaluation: Evaluation, at: str) -> str:
    mean, error = (
        evaluation.metrics.get(at + "reward/mean"),
        evaluation.metrics.get(at + "reward/stderr"),
    )
    return f"{_number(mean)} ± {_number(error)}" if mean is not None else ""


def _finite(value: float | None) -> float:
    return value if value is not None and math.isfinite(value) else 0.0


def _number(value: float | None) -> str:
    return f"{value:.4g}" if isinstance(value, int | float) else ""

"""A one-page picture of a run from its metrics.jsonl: reward and truncation rate per agent
(training episodes as solid lines; validation passes, where the run has them, dashed with their
standard error), loss, where each step's time went, and the token ledger: each record's
generated tokens by fate (trained, or why not) and each agent's share never trained. Written next
to metrics.jsonl at the end of every run.

    python -m gymrl.plot outputs/<run>/metrics.jsonl            # writes outputs/<run>/metrics.png

Several runs (seeds of one experiment) draw their validation reward per agent side by side:

    python -m gymrl.plot outputs/learn_seed*/metrics.jsonl -o seeds.png
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: runs on machines without a display
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from gymrl.tracking.records import read_records

_PER_AGENT = re.compile(
    r"^(?P<split>train|validation)/(?P<agent>[^/]+)/(?P<field>reward|noncontiguous_truncated)/mean$"
)
_TIMINGS = ("timing/wait_for_batch_s", "timing/train_s", "timing/refit_s", "timing/validation_s")
_LEDGER_AGENT = re.compile(r"^ledger/(?P<agent>[^/]+)/generated_tokens$")


def plot_run(records: list[dict[str, float]], output: Path, title: str) -> Path:
    """Draw the run's six panels into `output` (PNG) and return its path."""
    figure, axes = plt.subplots(3, 2, figsize=(11, 10), constrained_layout=True)
    figure.suptitle(title)
    panels = {
        "reward": (axes[0][0], "reward per agent (mean)"),
        "noncontiguous_truncated": (axes[0][1], "truncated episodes per agent (share)"),
    }
    by_step = {int(record["step"]): record for record in records}
    for field, (axis, label) in panels.items():
        series = _per_agent_series(records, field)
        # One colour per agent, shared by its training and validation lines.
        colour = {agent: f"C{i}" for i, agent in enumerate(sorted({a for _, a in series}))}
        for (split, agent), (steps, values) in sorted(series.items()):
            if split == "train":
                axis.plot(steps, values, marker="o", color=colour[agent], label=agent)
                continue
            stderr = [_value(by_step[step], f"validation/{agent}/{field}/stderr") for step in steps]
            axis.errorbar(
                steps,
                values,
                yerr=stderr,
                linestyle="--",
                marker="s",
                capsize=3,
                color=colour[agent],
                label=f"{agent} (validation, ± s.e.)",
            )
        axis.set_title(label)
        _step_axis(axis)
        axis.set_ylim(-0.05, 1.05)
        if axis.lines:
            axis.legend(fontsize="small")
    _plot_keys(axes[1][0], records, ("train/loss", "train/pg_loss"), "loss")
    _plot_keys(axes[1][1], records, _TIMINGS, "seconds per step")
    _plot_ledger(axes[2][0], records)
    _plot_untrained_share(axes[2][1], records)
    figure.savefig(output, dpi=110)
    plt.close(figure)
    return output


def plot_validation_runs(runs: dict[str, list[dict[str, float]]], output: Path, title: str) -> Path:
    """Validation reward (mean ± s.e.) against the step, one panel per agent plus the overall
    mean, one line per run: seeds of one experiment side by side."""
    agents = sorted(
        {
            agent
            for records in runs.values()
            for (split, agent) in _per_agent_series(records, "reward")
            if split == "validation"
        }
    )
    panels = [*agents, None]  # None: every agent's episodes together
    figure, axes = plt.subplots(
        1, len(panels), figsize=(4.2 * len(panels), 3.8), constrained_layout=True, squeeze=False
    )
    figure.suptitle(title)
    for axis, agent in zip(axes[0], panels, strict=True):
        prefix = f"validation/{agent}/reward" if agent else "validation/reward"
        for index, (label, records) in enumerate(runs.items()):
            points = [r for r in records if r.get(f"{prefix}/mean") is not None]
            if agent is None:  # the overall mean has no standard error of its own
                axis.plot(
                    [r["step"] for r in points],
                    [r[f"{prefix}/mean"] for r in points],
                    marker="s",
                    color=f"C{index}",
                    label=label,
                )
                continue
            axis.errorbar(
                [r["step"] for r in points],
                [r[f"{prefix}/mean"] for r in points],
                yerr=[_value(r, f"{prefix}/stderr") for r in points],
                marker="s",
                capsize=3,
                color=f"C{index}",
                label=label,
            )
        axis.set_title(f"{agent} (± s.e.)" if agent else "all agents")
        axis.set_ylabel("validation reward")
        _step_axis(axis)
        axis.set_ylim(-0.05, 1.05)
        axis.legend(fontsize="small")
    figure.savefig(output, dpi=110)
    plt.close(figure)
    return output


def _per_agent_series(
    records: list[dict[str, float]], field: str
) -> dict[tuple[str, str], tuple[list[int], list[float]]]:
    """(split, agent) -> the steps and mean values of `field`."""
    series: dict[tuple[str, str], tuple[list[int], list[float]]] = {}
    for record in records:
        for key, value in record.items():
            match = _PER_AGENT.match(key)
            if match and match["field"] == field and value is not None:
                steps, values = series.setdefault((match["split"], match["agent"]), ([], []))
                steps.append(int(record["step"]))
                values.append(value)
    return series


def _value(record: dict[str, float], key: str) -> float:
    """A logged value; 0 where it is missing or null (no error bar)."""
    value = record.get(key)
    return 0.0 if value is None else value


def _plot_keys(axis, records: list[dict[str, float]], keys: tuple[str, ...], title: str) -> None:
    for key in keys:
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        if points:
            steps, values = zip(*points, strict=True)
            axis.plot(steps, values, marker="o", label=key.split("/", 1)[1])
    axis.set_title(title)
    _step_axis(axis)
    if axis.lines:
        axis.legend(fontsize="small")


def _plot_ledger(axis, records: list[dict[str, float]]) -> None:
    """Stacked bars per record: trained tokens, then each cause of tokens never trained."""
    kept = [r for r in records if r.get("ledger/generated_tokens") is not None]
    steps = [r["step"] for r in kept]
    bottom = [0.0] * len(kept)
    # The causes as the records name them (gymrl/experience/ledger.py), in the order logged.
    causes = dict.fromkeys(k for r in kept for k in r if k.startswith("ledger/untrained_tokens/"))
    for name in ("trained_tokens", *(k.removeprefix("ledger/") for k in causes)):
        values = [_value(r, f"ledger/{name}") for r in kept]
        if any(values):
            axis.bar(steps, values, bottom=bottom, label=name.split("/")[-1])
            bottom = [low + value for low, value in zip(bottom, values, strict=True)]
    axis.set_title("generated tokens by fate (all agents)")
    _step_axis(axis)
    if kept:
        axis.legend(fontsize="small")


def _plot_untrained_share(axis, records: list[dict[str, float]]) -> None:
    """Per agent: the share of its generated tokens of each record that were never trained."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    for record in records:
        for key, generated in record.items():
            match = _LEDGER_AGENT.match(key)
            if match and generated:
                trained = _value(record, f"ledger/{match['agent']}/trained_tokens")
                steps, shares = series.setdefault(match["agent"], ([], []))
                steps.append(int(record["step"]))
                shares.append(1.0 - trained / generated)
    for agent, (steps, shares) in sorted(series.items()):
        axis.plot(steps, shares, marker="o", label=agent)
    axis.set_title("generated tokens never trained per agent (share)")
    _step_axis(axis)
    axis.set_ylim(-0.05, 1.05)
    if axis.lines:
        axis.legend(fontsize="small")


def _step_axis(axis) -> None:
    axis.set_xlabel("step")
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))


def main() -> None:
    # `python -OO` strips docstrings.
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("metrics", type=Path, nargs="+", help="a run's metrics.jsonl")
    parser.add_argument("-o", "--output", type=Path, help="PNG path (default: beside the input)")
    parser.add_argument("--title", help="the picture's title (default: the run folder's name)")
    args = parser.parse_args()
    if len(args.metrics) == 1:
        (metrics,) = args.metrics
        output = args.output or metrics.with_suffix(".png")
        plot_run(read_records(metrics), output, title=args.title or metrics.parent.name)
    else:
        if args.output is None:
            parser.error("several runs are drawn into one picture: name it with -o")
        runs = {path.parent.name: read_records(path) for path in args.metrics}
        output = plot_validation_runs(runs, args.output, title=args.title or "validation reward")
    print(output)


if __name__ == "__main__":
    main()

"""An offline sweep report: one HTML file comparing the points of a sweep, no network, no account.

    python -m gymrl.report outputs/multirun/<run.name>/<time>    # writes <that folder>/report.html
    python -m gymrl.report outputs/run_a outputs/run_b -o compare.html   # or any run folders
    python -m gymrl.report outputs/run_a/eval/start outputs/run_a/eval/step_6   # eval folders

The page holds, for every agent, reward and truncation rate against the step with one line per
point, the overall reward and loss, a table of every point (status, the keys that vary between
points, final metrics, folder) and the list of varied keys. Charts are inline SVG drawn by
matplotlib and the page has no script, stylesheet or font from elsewhere, so it reads the same
from a laptop on a plane as from the cluster.
"""

from __future__ import annotations

import argparse
import html
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from gymrl.tracking.eval_report import Evaluation, find_evaluations, render_evaluations
from gymrl.tracking.svg import figure_svg
from gymrl.tracking.sweep import (
    SUMMARY_METRICS,
    Point,
    read_point,
    split_overrides,
    sweep_points,
    varied_keys,
)

REPORT_FILENAME = "report.html"
# Which (split, agent) pairs a point logged; validation keys exist where the run validates.
_PER_AGENT = re.compile(
    r"^(?P<split>train|validation)/(?P<agent>[^/]+)/(reward|noncontiguous_truncated)/mean$"
)
_FIELDS = {"reward": "reward (mean)", "noncontiguous_truncated": "share of episodes truncated"}

_STYLE = """
body { font-family: sans-serif; margin: 24px; color: #222; }
h1 { font-size: 20px; } h2 { font-size: 17px; margin-top: 28px; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border: 1px solid #bbb; padding: 4px 8px; text-align: left; }
th { background: #eee; } td.failed, td.unfinished { color: #b00; font-weight: bold; }
.wide { overflow-x: auto; }
.charts { display: flex; flex-wrap: wrap; gap: 12px; }
figure.chart { margin: 0; } figure.chart svg { width: 480px; height: 300px; }
"""


def load_points(paths: Sequence[Path]) -> list[Point]:
    """Points from sweep folders (every job folder in them) and plain run folders."""
    points: list[Point] = []
    for path in paths:
        swept = sweep_points(path)
        points.extend(swept if swept else [read_point(path)])
    if not points:
        raise SystemExit(f"no run found in {', '.join(map(str, paths))}")
    return points


def point_labels(points: Sequence[Point]) -> list[str]:
    """`#n key=value ...` with the keys that vary; the folder name where nothing varies."""
    keys = varied_keys(list(points))
    labels = []
    for number, point in enumerate(points):
        chosen = dict(split_overrides(point.overrides))
        varied = " ".join(f"{key}={chosen.get(key, '-')}" for key in keys)
        labels.append(f"#{number} {varied or point.output_dir.name}")
    return labels


def render(points: Sequence[Point], title: str, evaluations: Sequence[Evaluation] = ()) -> str:
    """The page: the runs' sections (when there are points), then the evaluations'."""
    sections = _runs_section(points) if points else ""
    if evaluations:
        sections += render_evaluations(evaluations)
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>\n"
        f"<h1>{html.escape(title)}</h1>\n{sections}</body></html>\n"
    )


def _runs_section(points: Sequence[Point]) -> str:
    labels = point_labels(points)
    keys = varied_keys(list(points))
    agents = sorted(
        {
            (m["split"], m["agent"])
            for p in points
            for r in p.records
            for k in r
            if (m := _PER_AGENT.match(k))
        }
    )
    charts = [
        _chart(
            points,
            labels,
            f"{split}/{agent}/{field}/mean",
            f"{agent} ({split}): {label}",
            ylim=(-0.05, 1.05),
        )
        for split, agent in agents
        for field, label in _FIELDS.items()
    ]
    charts.append(_chart(points, labels, "train/reward/mean", "reward, all agents (mean)"))
    charts.append(_chart(points, labels, "train/loss", "loss"))
    varied = ", ".join(f"<code>{html.escape(k)}</code>" for k in keys) or "none"
    return (
        f"<p>{len(points)} point(s); keys that vary: {varied}.</p>\n"
        f"<h2>Final metrics</h2>\n{_table(points, labels, keys, agents)}\n"
        f"<h2>Per agent and overall, against the step</h2>\n"
        f"<div class='charts'>{''.join(charts)}</div>\n"
    )


def _chart(
    points: Sequence[Point],
    labels: Sequence[str],
    key: str,
    title: str,
    ylim: tuple[float, float] | None = None,
) -> str:
    figure, axis = plt.subplots(figsize=(6.4, 4.0), constrained_layout=True)
    for point, label in zip(points, labels, strict=True):
        series = [(r["step"], r[key]) for r in point.records if r.get(key) is not None]
        if series:
            steps, values = zip(*series, strict=True)
            axis.plot(steps, values, marker="o", label=label)
    axis.set_title(title)
    axis.set_xlabel("step")
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    if ylim:
        axis.set_ylim(*ylim)
    if axis.lines:
        axis.legend(fontsize="small")
    else:
        axis.text(0.5, 0.5, "not logged", ha="center", transform=axis.transAxes)
    return f"<figure class='chart' data-key='{html.escape(key)}'>{figure_svg(figure)}</figure>"


def _table(
    points: Sequence[Point],
    labels: Sequence[str],
    keys: Sequence[str],
    agents: Sequence[tuple[str, str]],
) -> str:
    per_agent = (f"{split}/{agent}/{field}/mean" for split, agent in agents for field in _FIELDS)
    metrics = [*SUMMARY_METRICS, *per_agent]
    metrics = [m for m in metrics if any(m in p.final for p in points)]
    header = ["point", "status", *keys, "final step", *metrics, "folder", "error"]
    rows = ["<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>"]
    for point, label in zip(points, labels, strict=True):
        chosen = dict(split_overrides(point.overrides))
        cells: list[Any] = [
            label.split(" ", 1)[0],
            point.status,
            *(chosen.get(key, "") for key in keys),
            point.final.get("step", ""),
            *(_number(point.final.get(m)) for m in metrics),
            str(point.output_dir),
            " ".join((point.error or "").split())[:300],
        ]
        row = "".join(
            f"<td class='{html.escape(point.status)}'>{html.escape(str(c))}</td>"
            if column == 1
            else f"<td>{html.escape(str(c))}</td>"
            for column, c in enumerate(cells)
        )
        rows.append(f"<tr class='point'>{row}</tr>")
    return "<div class='wide'><table id='points'>\n" + "\n".join(rows) + "\n</table></div>"


def _number(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, int | float) else ""


def main() -> None:
    parser = argparse.ArgumentParser(description="Write an offline HTML report of a sweep.")
    parser.add_argument(
        "paths", type=Path, nargs="+", help="a sweep folder, run folders, or eval folders"
    )
    parser.add_argument(
        "-o", "--output", type=Path, help=f"HTML path (default: <first path>/{REPORT_FILENAME})"
    )
    args = parser.parse_args()
    found = {path: find_evaluations(path) for path in args.paths}
    evaluations = [evaluation for path in args.paths for evaluation in found[path]]
    runs = [path for path in args.paths if not found[path]]
    points = load_points(runs) if runs else []
    output = args.output or args.paths[0] / REPORT_FILENAME
    kind = "Sweep report" if points else "Eval report"
    title = f"{kind}: " + ", ".join(str(p) for p in args.paths)
    output.write_text(render(points, title, evaluations), encoding="utf-8")
    print(output)


if __name__ == "__main__":
    main()

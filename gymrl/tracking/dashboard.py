"""The recipe's W&B dashboard as code: one workspace whose panels name documented metric keys.

    python -m gymrl.dashboard --entity ENTITY --project gym-grpo     # save it (needs W&B login)

Every chart uses the GRPO step (`step`, defined as the x axis by the metrics logger) and is
grouped into the sections a person checks in order: is it learning (reward and truncation per
agent, train and validation), is the update healthy (loss and its parts), where the time goes
(step time split), is async keeping up (trajectory age, evictions, buffer), and do rollouts work
(failures, throughput). `tests/gymrl/tracking/test_dashboard.py` builds it offline and checks
that every key and key pattern here is one docs/metrics.md documents, so a renamed metric breaks
the test, not the dashboard.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from gymrl.tracking.metrics_logger import STEP_KEY

DEFAULT_NAME = "GRPO (gym-grpo-recipes)"
AGENT = r"[^/]+"  # one path segment: an agent's name


@dataclass(frozen=True)
class Chart:
    """A line chart: fixed metric keys and/or one regex over keys (one line per matching key)."""

    title: str
    keys: tuple[str, ...] = ()
    regex: str | None = None
    stacked: bool = False


def _per_agent(split: str, field: str) -> str:
    return rf"^{split}/{AGENT}/{field}/mean$"


SECTIONS: tuple[tuple[str, tuple[Chart, ...]], ...] = (
    (
        "Reward per agent",
        (
            Chart("train reward per agent", regex=_per_agent("train", "reward")),
            Chart("validation reward per agent", regex=_per_agent("validation", "reward")),
            Chart("train reward (all episodes)", keys=("train/reward/mean",)),
        ),
    ),
    (
        "Truncation per agent",
        (
            Chart(
                "train: share of episodes truncated",
                regex=_per_agent("train", "noncontiguous_truncated"),
            ),
            Chart(
                "validation: share of episodes truncated",
                regex=_per_agent("validation", "noncontiguous_truncated"),
            ),
            Chart(
                "train: turns dropped per episode",
                regex=_per_agent("train", "noncontiguous_dropped_turns"),
            ),
        ),
    ),
    (
        "Loss",
        (
            Chart("loss and its parts", keys=("train/loss", "train/pg_loss", "train/kl")),
            Chart("clip fraction", keys=("train/clip_fraction",)),
            Chart(
                "importance ratio",
                keys=("train/importance_ratio/mean", "train/importance_ratio/max"),
            ),
            Chart("gradient norm", keys=("train/grad_norm",)),
            Chart("entropy (approx.)", keys=("train/approx_entropy",)),
            Chart("learning rate", keys=("train/lr",)),
        ),
    ),
    (
        "Step time",
        (
            Chart(
                "where a step's time goes (s)",
                keys=(
                    "timing/wait_for_batch_s",
                    "timing/train_s",
                    "timing/refit_s",
                    "timing/checkpoint_s",
                ),
                stacked=True,
            ),
            Chart("step time (s)", keys=("timing/step_s",)),
        ),
    ),
    (
        "Async health",
        (
            Chart(
                "trajectory age (steps)",
                keys=("async/trajectory_age/mean", "async/trajectory_age/max"),
            ),
            Chart("groups evicted as stale (total)", keys=("async/evicted_stale_total",)),
            Chart("groups waiting in the buffer", keys=("async/buffer_groups",)),
        ),
    ),
    (
        "Rollouts and throughput",
        (
            Chart(
                "failures, retries, dropped groups (totals)",
                keys=(
                    "rollout/failures_total",
                    "rollout/retries_total",
                    "rollout/dropped_groups_total",
                ),
            ),
            Chart("trainer tokens per second", keys=("perf/train_tokens_per_s",)),
            Chart("generated tokens per step", keys=("rollout/generated_tokens",)),
            Chart("group wall time (s)", keys=("rollout/group_s/mean",)),
        ),
    ),
)


def build_workspace(entity: str, project: str, name: str = DEFAULT_NAME):
    """The workspace object (nothing is sent until `.save()`)."""
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws

    sections = []
    for title, charts in SECTIONS:
        panels: list[wr.interface.PanelTypes] = [
            wr.LinePlot(
                title=chart.title,
                x=STEP_KEY,
                y=list(chart.keys),
                metric_regex=chart.regex,
                plot_type="stacked-area" if chart.stacked else "line",
            )
            for chart in charts
        ]
        sections.append(ws.Section(name=title, panels=panels, is_open=True))
    return ws.Workspace(
        entity=entity,
        project=project,
        name=name,
        sections=sections,
        settings=ws.WorkspaceSettings(x_axis=STEP_KEY),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="Save the recipe's W&B workspace.")
    parser.add_argument("--entity", required=True, help="W&B entity (team or user)")
    parser.add_argument("--project", required=True, help="W&B project the runs log to")
    parser.add_argument("--name", default=DEFAULT_NAME, help="workspace name")
    args = parser.parse_args()
    workspace = build_workspace(args.entity, args.project, args.name)
    workspace.save()
    print(workspace.url)


if __name__ == "__main__":
    main()

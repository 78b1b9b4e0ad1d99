"""The W&B dashboard, built offline: every panel charts documented metric keys on the step axis."""

import json
import re

import pytest

from gymrl.tracking.dashboard import SECTIONS, build_workspace
from gymrl.tracking.metrics_logger import STEP_KEY
from tests.support.metric_docs import documented_keys, documented_patterns

# Concrete stand-ins for the placeholders. `<field>` stands for each field some row spells out
# (`train/<agent>/reward/<red>` -> reward), so a panel pattern naming a field that no row names
# matches nothing.
EXAMPLES = {"<agent>": "calculator_agent", "<red>": "mean"}


def documented_examples() -> list[str]:
    keys = documented_keys()
    fields = {m[1] for key in keys if (m := re.match(r"^\w+/<agent>/(\w+)/", key))}
    examples = []
    for key in keys:
        for placeholder, example in EXAMPLES.items():
            key = key.replace(placeholder, example)
        examples += (
            [key.replace("<field>", field) for field in fields] if "<field>" in key else [key]
        )
    return examples


def panels():
    workspace = build_workspace("offline-entity", "offline-project")
    return [(section.name, panel) for section in workspace.sections for panel in section.panels]


@pytest.mark.parametrize("section,panel", panels(), ids=lambda value: getattr(value, "title", ""))
def test_every_panel_charts_documented_keys_against_the_grpo_step(section, panel):
    assert panel.x == STEP_KEY
    assert panel.y or panel.metric_regex, f"{section}/{panel.title} charts nothing"
    patterns = documented_patterns()
    for key in panel.y:
        assert any(p.match(key) for p in patterns), f"{key} is not in docs/metrics.md"
    if panel.metric_regex:
        matched = [k for k in documented_examples() if re.match(panel.metric_regex, k)]
        assert matched, f"{panel.metric_regex} matches no documented key"


def test_the_sections_cover_what_the_issue_asks_for():
    names = [name for name, _ in SECTIONS]
    assert names == [
        "Reward per agent",
        "Truncation per agent",
        "Loss",
        "Step time",
        "Async health",
        "Rollouts and throughput",
    ]
    workspace = build_workspace("e", "p")
    assert workspace.settings.x_axis == STEP_KEY
    # What `save()` sends, built without a network: every chart's keys are in it.
    spec = json.dumps(workspace._to_model().model_dump(by_alias=True), default=str)
    for _, charts in SECTIONS:
        for chart in charts:
            for ref in (*chart.keys, chart.regex or ""):
                assert json.dumps(ref)[1:-1] in spec, ref


def test_a_misspelt_key_is_caught():
    """The check itself can fail: a key one letter off matches no documented pattern."""
    assert not any(p.match("train/los") for p in documented_patterns())
    regex = r"^train/[^/]+/rewrd/mean$"
    assert not [k for k in documented_examples() if re.match(regex, k)]

"""The W&B dashboard, built offline: every panel charts documented metric keys on the step axis."""

import json
import re

import pytest
from metric_docs import PLACEHOLDERS, documented_keys, documented_patterns

from gymrl.dashboard import SECTIONS, build_workspace
from gymrl.metrics_logger import STEP_KEY

# Concrete stand-ins for the placeholders: `<field>` gets a name no row spells out, so a panel
# pattern naming a field must match a row that documents that field itself.
EXAMPLES = {"<agent>": "calculator_agent", "<field>": "undocumented_field", "<red>": "mean"}


def documented_examples() -> list[str]:
    examples = []
    for key in documented_keys():
        for placeholder in PLACEHOLDERS:
            key = key.replace(placeholder, EXAMPLES[placeholder])
        examples.append(key)
    return examples


def panels():
    workspace = build_workspace("offline-entity", "offline-project")
    return [(section.name, panel) for section in workspace.sections for panel in section.panels]


def _validation_undocumented(panel) -> bool:
    """Validation keys arrive with validation rollouts (issue 9); until docs/metrics.md has
    them, their panels are the one thing allowed to wait."""
    refers = [*panel.y, panel.metric_regex or ""]
    return any("validation" in ref for ref in refers) and not any(
        key.startswith("validation/") for key in documented_keys()
    )


@pytest.mark.parametrize("section,panel", panels(), ids=lambda value: getattr(value, "title", ""))
def test_every_panel_charts_documented_keys_against_the_grpo_step(section, panel):
    if _validation_undocumented(panel):
        pytest.skip("docs/metrics.md documents no validation/ keys yet")
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

"""docs/configuration.md names every option of every config group and every experiment, so a
group or experiment added to conf/ cannot go unmentioned."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "configuration.md"
CONF = REPO / "conf"


def table_rows(text: str, first_column: str) -> dict[str, str]:
    """The rows of the markdown table whose header starts with `first_column`: first cell (its
    backticks removed) -> the rest of the row."""
    header = text.index(f"| {first_column} |")
    rows = {}
    for line in text[header:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = " | ".join(cells[1:])
    return rows


def test_every_group_option_is_named():
    groups = table_rows(DOC.read_text(), "group")
    for folder in sorted(p for p in CONF.iterdir() if p.is_dir() and p.name != "experiment"):
        options = {path.stem for path in folder.glob("*.yaml")}
        named = set(re.findall(r"`(\w+)`", groups.get(folder.name, "")))
        missing = options - named
        assert not missing, f"docs/configuration.md's `{folder.name}` row misses {missing}"


def test_every_experiment_is_named():
    experiments = table_rows(DOC.read_text(), "experiment")
    assert set(experiments) == {path.stem for path in (CONF / "experiment").glob("*.yaml")}

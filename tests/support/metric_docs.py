"""The metric keys docs/metrics.md documents, as patterns (placeholders become regexes).

Shared by the tests that hold the recipe to its documentation: the keys a run logs
(tests/recipes/test_smoke_run.py) and the keys the W&B dashboard charts
(tests/gymrl/tracking/test_dashboard.py).
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLACEHOLDERS = {
    "<agent>": r"[A-Za-z0-9_.-]+",
    "<field>": r"[A-Za-z0-9_.-]+",
    "<red>": r"(mean|min|max)",
    "<k>": r"[0-9]+",
    "<cause>": (
        r"(no_token_ids|retokenized|assistant_edited|history_edited|other"
        r"|unknown_in_generation|unknown_in_history)"
    ),
}


def documented_keys() -> list[str]:
    """Every key of the first column of docs/metrics.md's tables, placeholders as written."""
    first_cells = re.findall(r"^\| (`[^|]+)\|", (ROOT / "docs/metrics.md").read_text(), re.M)
    return [key for cell in first_cells for key in re.findall(r"`([^`]+)`", cell)]


def documented_patterns() -> list[re.Pattern]:
    patterns = []
    for key in documented_keys():
        pattern = re.escape(key)
        for placeholder, regex in PLACEHOLDERS.items():
            pattern = pattern.replace(re.escape(placeholder), regex)
        patterns.append(re.compile(pattern + "$"))
    return patterns

"""Read a run's metrics.jsonl back: one dict per logged step. Kept apart from the plots so that
what reads records (the entry point's objective, sweeps) never imports matplotlib."""

from __future__ import annotations

import json
from pathlib import Path


def read_records(path: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

"""Seconds per GRPO step, split into generation, training and refit, with async on and off.

Runs the recipe through its real entry point once per setting (same seed, same config otherwise)
and summarises each run's metrics.jsonl. Generation time is what the trainer waited for its batch
(`timing/wait_for_batch_s`): with async on, generation of the next step overlaps training, so
this is the part of generation that was not hidden.

    python benchmarks/bench_grpo_step.py                       # the embedded default (SmolLM2)
    python benchmarks/bench_grpo_step.py +experiment=smoke     # the tiny model, quicker

The first step includes warm-up (model conversion check, first compilation of kernels) and is
reported apart.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ("timing/step_s", "timing/wait_for_batch_s", "timing/train_s", "timing/refit_s")


def run(overrides: list[str], output: Path) -> list[dict]:
    command = [
        sys.executable,
        "recipes/grpo.py",
        *overrides,
        f"run.output_dir={output}",
        f"hydra.run.dir={output}",
        "logger.progress_bar=false",
        "checkpoint.every_n_steps=0",
    ]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True, timeout=3600)
    lines = (output / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def summarise(label: str, records: list[dict]) -> str:
    steady = records[1:] or records
    cells = [f"{statistics.median(r[key] for r in steady):.1f}" for key in COLUMNS]
    first = f"{records[0]['timing/step_s']:.1f}"
    tokens = statistics.median(r["rollout/generated_tokens"] for r in steady)
    return f"| {label} | {first} | " + " | ".join(cells) + f" | {tokens:.0f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description="GRPO step time, async vs sync")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both runs")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for label, mode in (("async", "true"), ("sync", "false")):
            records = run([*args.overrides, f"grpo.async_enabled={mode}"], Path(scratch) / label)
            rows.append(summarise(label, records))
    print(
        "| mode | first step s | step s | generation (wait) s | train s | refit s | "
        "generated tokens/step |"
    )
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

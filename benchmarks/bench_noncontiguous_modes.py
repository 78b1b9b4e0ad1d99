"""Generated vs trained tokens of `+experiment=smoke_noncontiguous` under each way of handling a
non-contiguous episode, through the real entry point, one run after the other:

    raise   truncation off: the first divergence stops the run (the PR's default)
    drop    env.nemo_gym.truncate_noncontiguous_episodes=true: the tail is dropped
    split   ... and env.nemo_gym.split_noncontiguous_segments=N: tails kept as trajectories
    stop    ... and generation.server.stop_on_divergence=true: the tail is never generated

    python benchmarks/bench_noncontiguous_modes.py                 # all four, the smoke's 3 steps
    python benchmarks/bench_noncontiguous_modes.py --modes drop stop -- grpo.num_steps=6

Sums the token ledger over the run's records (docs/metrics.md, `ledger/...`) and the policy
server's divergence counts, and times each run from process start to exit (the run's own
start-up included, the same for every mode).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRUNCATE = "env.nemo_gym.truncate_noncontiguous_episodes"
MODES: dict[str, tuple[str, ...]] = {
    "raise": (f"{TRUNCATE}=false",),
    "drop": (f"{TRUNCATE}=true",),
    "split": (f"{TRUNCATE}=true", "env.nemo_gym.split_noncontiguous_segments=3"),
    "stop": (f"{TRUNCATE}=true", "generation.server.stop_on_divergence=true"),
}
# Summed over the run's records; a key a record lacks counts 0 there.
SUMMED = (
    "ledger/generated_tokens",
    "ledger/trained_tokens",
    "ledger/untrained_tokens/dropped_tail",
    "ledger/untrained_tokens/validation",
    "generation/divergence_detected",
    "generation/divergence_stopped",
    "timing/wait_for_batch_s",
    "timing/validation_s",
)


def run_mode(mode: str, overrides: list[str], out: Path) -> dict[str, float | str]:
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "recipes/grpo.py",
            "+experiment=smoke_noncontiguous",
            *MODES[mode],
            *overrides,
            f"run.output_dir={out}",
            f"hydra.run.dir={out}",
            "logger.progress_bar=false",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    seconds = time.monotonic() - started
    metrics = out / "metrics.jsonl"
    records = (
        [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    )
    row: dict[str, float | str] = {
        "mode": mode,
        "exit": done.returncode,
        "steps": len([r for r in records if "train/loss" in r]),
        "seconds": round(seconds, 1),
    }
    for key in SUMMED:
        row[key] = sum(float(record.get(key, 0.0)) for record in records)
    if done.returncode != 0:
        row["stopped_by"] = done.stderr.strip().splitlines()[-1][:160] if done.stderr else "?"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=list(MODES),
        default=list(MODES),
        help="in this order; a mode named twice runs twice (alternate modes to see the drift)",
    )
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("overrides", nargs="*", help="recipe overrides for every mode")
    args = parser.parse_args()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="noncontiguous_modes_") as scratch:
        for mode in args.modes:
            rows.append(run_mode(mode, args.overrides, Path(scratch) / f"{len(rows)}_{mode}"))
            print(json.dumps(rows[-1]), flush=True)
    header = ("mode", "exit", "steps", "seconds", *SUMMED)
    print("\n| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print(
            "| "
            + " | ".join(
                f"{row[key]:g}" if isinstance(row[key], float) else str(row[key]) for key in header
            )
            + " |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

"""Router replay on the tiny MoE, on and off, side by side: the train-inference mismatch, the
route bytes, the rollout time.

Runs `+experiment=moe_r3_cpu` (the real SGLang server and the Megatron trainer on this CPU) once
with `policy.router_replay.enabled=true` and once with `false`, in the dtype asked (bfloat16 by
default: in float32 both engines already route identically), and prints, per run, the means over
its steps of `train/mismatch/k3_kl`, `train/mismatch/large_delta_share`,
`rollout/group_s/mean`, and with replay on `router_replay/bytes_per_token` and
`router_replay/fallback_token_share` (docs/metrics.md).

    make sglang-venv megatron-venv
    python benchmarks/bench_router_replay.py [--dtype bfloat16] [--steps 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURES = (
    "train/mismatch/k3_kl",
    "train/mismatch/large_delta_share",
    "rollout/group_s/mean",
    "router_replay/bytes_per_token",
    "router_replay/fallback_token_share",
)


def run(replay: bool, dtype: str, steps: int, out: Path) -> dict[str, float]:
    """One run of the experiment; the means of :data:`FIGURES` over its steps, and its wall time."""
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "recipes" / "grpo.py"),
            "+experiment=moe_r3_cpu",
            f"policy.router_replay.enabled={str(replay).lower()}",
            f"policy.dtype={dtype}",
            f"grpo.num_steps={steps}",
            f"checkpoint.every_n_steps={steps}",
            f"run.output_dir={out}",
            "logger.wandb.mode=disabled",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if done.returncode != 0:
        raise SystemExit(f"the run with replay={replay} failed:\n{done.stderr[-4000:]}")
    records = [
        json.loads(line)
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if '"step"' in line
    ]
    figures = {
        key: statistics.fmean(r[key] for r in records if key in r)
        for key in FIGURES
        if any(key in r for r in records)
    }
    return figures | {"wall_s": time.monotonic() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="bench_r3_"))
    results = {
        replay: run(replay, args.dtype, args.steps, out / f"replay_{replay}")
        for replay in (False, True)
    }
    print(f"tiny Qwen3-MoE, {args.dtype}, {args.steps} steps of moe_r3_cpu")
    print(f"{'figure':40} {'replay off':>14} {'replay on':>14}")
    for key in (*FIGURES, "wall_s"):
        cells = [results[replay].get(key) for replay in (False, True)]
        print(f"{key:40} " + " ".join(f"{'-' if c is None else f'{c:.3g}':>14}" for c in cells))


if __name__ == "__main__":
    main()

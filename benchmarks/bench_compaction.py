"""Compaction against none, on the same Gym environment, agent and seeds (issue 44).

    python benchmarks/bench_compaction.py                          # seeds 0-2, both variants
    python benchmarks/bench_compaction.py --seeds 0 --steps 2 --val-rows 8
    python benchmarks/bench_compaction.py --summarise-only         # the table again

Each run is `recipes/grpo.py +experiment=compaction_gym` (Gym's compaction agent with the
tool-output recency policy on learn_gym's environment and rows), validated greedily at the start
and the end on the first `--val-rows` held-out rows. The variant `none` is the same agent with
`context_history.enabled=false`: Gym's agent loop without a semantic history, so nothing is
compacted and nothing else changes (the same `max_steps`, budgets, adapter and rows). The runs go
one after the other, the load average written before each.

Per run, from its metrics.jsonl: episodes trained; per episode (means over the steps) the
compactions, the segments trained and the generated tokens trained (the first segment's and
the later segments'); the share of generated tokens trained (the token ledger: trained over
generated, validation excluded); and the validation reward at the start and the end. The table
is printed and written to `--out` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from gymrl.tracking.records import read_records

REPO = Path(__file__).resolve().parents[1]
AGENT = "math_advanced_calculations_simple_agent"
HISTORY = (
    f"env.nemo_gym.{AGENT}.responses_api_agents.simple_agent_with_tool_recency."
    "context_history.enabled"
)
VARIANTS = {"compaction": (), "none": (f"{HISTORY}=false",)}
VAL_ROWS = REPO / "data" / "learn_gym" / "val.jsonl"


def run_folder(out_root: Path, variant: str, seed: int) -> Path:
    return out_root / f"{variant}_seed{seed}"


def run(variant: str, seed: int, *, steps: int, val_rows: Path, out_root: Path) -> None:
    folder = run_folder(out_root, variant, seed)
    command = [
        sys.executable,
        str(REPO / "recipes" / "grpo.py"),
        "+experiment=compaction_gym",
        f"run.seed={seed}",
        f"run.output_dir={folder}",
        f"grpo.num_steps={steps}",
        "grpo.val_at_start=true",
        "grpo.val_at_end=true",
        f"env.data.val_jsonl={val_rows}",
        *VARIANTS[variant],
    ]
    print(f"{variant} seed {seed}: load average {os.getloadavg()}", flush=True)
    subprocess.run(command, check=True, cwd=REPO)


def summary(folder: Path) -> dict[str, float]:
    """One run's figures (the module docstring says which)."""
    records = read_records(folder / "metrics.jsonl")
    steps = [r for r in records if f"train/{AGENT}/generated_tokens/mean" in r]
    validations = [r["validation/reward/mean"] for r in records if "validation/reward/mean" in r]

    def per_step_mean(field: str) -> float:
        key = f"train/{AGENT}/{field}/mean"
        return statistics.fmean(r.get(key, 0.0) for r in steps)

    # The ledger's records also account the validation passes' tokens: not training's.
    generated = sum(
        r["ledger/generated_tokens"] - r.get("ledger/untrained_tokens/validation", 0.0)
        for r in steps
    )
    trained = sum(r["ledger/trained_tokens"] for r in steps)
    return {
        "episodes": sum(r["rollout/episodes"] for r in steps),
        "compactions_per_episode": per_step_mean("compactions"),
        "segments_per_episode": per_step_mean("compaction_segments") or 1.0,
        "first_segment_tokens_per_episode": per_step_mean("generated_tokens"),
        "later_segment_tokens_per_episode": per_step_mean("compaction_segment_tokens"),
        "trained_share_of_generated": trained / generated if generated else float("nan"),
        "validation_start": validations[0],
        "validation_end": validations[-1],
    }


def table(results: dict[str, dict[str, float]]) -> str:
    columns = list(next(iter(results.values())))
    lines = [
        "| run | " + " | ".join(columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for name, figures in results.items():
        lines.append(f"| {name} | " + " | ".join(f"{figures[c]:.3g}" for c in columns) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--val-rows", type=int, default=32, help="first held-out rows validated")
    parser.add_argument("--out-root", type=Path, default=REPO / "outputs" / "bench_compaction")
    parser.add_argument("--summarise-only", action="store_true")
    args = parser.parse_args(argv)
    args.out_root.mkdir(parents=True, exist_ok=True)
    val_rows = args.out_root / f"val_first_{args.val_rows}.jsonl"
    val_rows.write_text("".join(VAL_ROWS.read_text().splitlines(keepends=True)[: args.val_rows]))
    if not args.summarise_only:
        for seed in args.seeds:
            for variant in args.variants:
                run(variant, seed, steps=args.steps, val_rows=val_rows, out_root=args.out_root)
    results = {
        f"{variant} seed {seed}": summary(run_folder(args.out_root, variant, seed))
        for variant in args.variants
        for seed in args.seeds
        if (run_folder(args.out_root, variant, seed) / "metrics.jsonl").exists()
    }
    print(table(results))
    (args.out_root / "table.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

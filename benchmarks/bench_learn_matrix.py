"""Issue 21's measurement matrix: `+experiment=learn` under each GRPO option, several seeds.

    python benchmarks/bench_learn_matrix.py                    # every variant, seeds 0-2
    python benchmarks/bench_learn_matrix.py --variants sync_ds_on --seeds 0 1 2
    python benchmarks/bench_learn_matrix.py --summarise-only   # the table and picture again

Each run is `recipes/grpo.py +experiment=learn` with 128 held-out rows per agent (so one agent's
final validation mean has a standard error of about 0.04, and the variants' effects can be read
against it), no middle validation pass, and the variant's overrides (`VARIANTS`). The runs go
one after the other, each alone on the machine, with the load average written before it.

Validation is greedy and the held-out rows come from their own seed, so the validation reward
*before* step 1 depends only on the starting weights: the matrix measures it once, in the first
run it launches (`grpo.val_at_start=true`), and every other run skips that pass
(`grpo.val_at_start=false`) and is compared with it.

For every run: the final validation reward per agent and overall, its rise over the start, and
the rise per minute of training (the steps' wall time without validation passes: what the
option costs or saves in rollouts and training). For every variant, over its seeds: the mean
rise, its seed-to-seed standard error, and how many seeds rose per agent. The table is printed
and written to `--out` (JSON); the picture (`--picture`) shows each seed's final validation
reward per agent and variant, and each seed's overall rise against its training minutes (a
variant's slope is its rise per minute). Training reward is left out: dynamic sampling trains
only groups whose rewards differ, so its training reward is not comparable with the others'.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gymrl.tracking.records import read_records

REPO = Path(__file__).resolve().parents[1]
OUTPUTS = REPO / "outputs"
COMMON_OVERRIDES = (
    "+experiment=learn",
    "env.data.num_builtin_val_rows_per_agent=128",
    "grpo.val_period=0",
    "grpo.val_at_end=true",
)
ASYNC = "grpo.async_enabled=true"
VARIANTS: dict[str, tuple[str, ...]] = {
    # The baseline: the experiment as it is (sync steps, no dynamic sampling, token_truncate).
    "sync_ds_off": (),
    "sync_ds_on": ("grpo.dynamic_sampling.enabled=true",),
    "async_token_truncate": (ASYNC, "loss.off_policy_correction.mode=token_truncate"),
    "async_token_mask": (ASYNC, "loss.off_policy_correction.mode=token_mask"),
    "async_sequence_truncate": (ASYNC, "loss.off_policy_correction.mode=sequence_truncate"),
    "async_sequence_mask": (ASYNC, "loss.off_policy_correction.mode=sequence_mask"),
    # Issue 45: a rank-16 LoRA adapter at ten times full training's learning rate (the starting
    # point "LoRA Without Regret" gives), against sync_ds_off on the same seeds.
    "lora_r16": ("trainer.lora.enabled=true", "trainer.optimizer.lr=3e-4"),
}
SIDECAR = "matrix.json"  # the driver's own record of a run: command, load average, exit time


def run_name(variant: str, seed: int) -> str:
    return f"matrix_{variant}_seed{seed}"


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def read_metrics(name: str) -> list[dict[str, Any]]:
    path = OUTPUTS / name / "metrics.jsonl"
    return read_records(path) if path.exists() else []


def matrix_runs_on_disk() -> list[str]:
    """Every matrix run under outputs/, whatever seeds this invocation asks for: the shared
    start pass may sit in a run of another seed (it is the very first run launched)."""
    return sorted(path.name for path in OUTPUTS.glob("matrix_*_seed*") if path.is_dir())


def start_run(names: Sequence[str]) -> str | None:
    """The first of `names` whose metrics hold a validation pass before step 1."""
    for name in names:
        if any(r.get("step") == 0 and "validation/reward/mean" in r for r in read_metrics(name)):
            return name
    return None


def launch(variant: str, seed: int, validate_at_start: bool) -> None:
    name = run_name(variant, seed)
    command = [
        sys.executable,
        str(REPO / "recipes" / "grpo.py"),
        *COMMON_OVERRIDES,
        *VARIANTS[variant],
        f"grpo.val_at_start={str(validate_at_start).lower()}",
        f"run.seed={seed}",
        f"run.name={name}",
    ]
    load = load_average()
    print(f"[matrix] {name}, load average {load}: {' '.join(command)}", flush=True)
    started = time.monotonic()
    subprocess.run(command, check=True, cwd=REPO)
    record = {"command": command, "load_average": load, "exit_s": time.monotonic() - started}
    (OUTPUTS / name / SIDECAR).write_text(json.dumps(record, indent=2) + "\n")


# ------------------------------------------------------------------------------ figures
def validation_passes(records: Sequence[Mapping[str, Any]]) -> dict[int, dict[str, float]]:
    """step -> {agent: mean, agent + '/stderr': s.e., 'overall': mean} for every pass."""
    passes: dict[int, dict[str, float]] = {}
    for record in records:
        if "validation/reward/mean" not in record:
            continue
        figures = {"overall": record["validation/reward/mean"]}
        for key, value in record.items():
            parts = key.split("/")
            if len(parts) == 4 and parts[0] == "validation" and parts[2] == "reward":
                if parts[3] == "mean":
                    figures[parts[1]] = value
                elif parts[3] == "stderr":
                    figures[parts[1] + "/stderr"] = value
        passes[int(record["step"])] = figures
    return passes


def agents_of(figures: Mapping[str, float]) -> list[str]:
    return sorted(k for k in figures if k != "overall" and not k.endswith("/stderr"))


def overall_stderr(figures: Mapping[str, float]) -> float:
    """Standard error of the overall mean of equally many rows per agent."""
    errors = [figures[f"{agent}/stderr"] for agent in agents_of(figures)]
    return math.sqrt(sum(e * e for e in errors)) / len(errors)


def run_figures(name: str, start: Mapping[str, float]) -> dict[str, Any] | None:
    records = read_metrics(name)
    passes = validation_passes(records)
    last_step = max((int(r["step"]) for r in records if "timing/step_s" in r), default=0)
    if last_step not in passes or last_step == 0:
        return None  # not finished (or never validated at the end)
    final = passes[last_step]
    train_s = sum(
        r["timing/step_s"] - r.get("timing/validation_s", 0.0)
        for r in records
        if r.get("step", 0) >= 1 and "timing/step_s" in r
    )
    sidecar = OUTPUTS / name / SIDECAR
    driver = json.loads(sidecar.read_text()) if sidecar.exists() else {}
    rise = final["overall"] - start["overall"]
    return {
        "run": name,
        "final": final,
        "final_overall_stderr": overall_stderr(final),
        "rise": rise,
        "rise_per_agent": {a: final[a] - start[a] for a in agents_of(final)},
        "train_min": train_s / 60,
        "rise_per_train_min": rise / (train_s / 60),
        "exit_s": driver.get("exit_s", math.nan),
        "load_average": driver.get("load_average", ""),
        "episodes": sum(r.get("rollout/episodes", 0) for r in records),
        "uniform_dropped": max((_sum_of(r, "/uniform_dropped_total") for r in records), default=0),
        "uniform_over_budget": max(
            (r.get("rollout/uniform_over_budget_total", 0) for r in records), default=0
        ),
        "masked_share": _mean_of(records, "/off_policy/masked_share"),
        "capped_share": _mean_of(records, "/off_policy/capped_share"),
        "ratio_range": {
            agent: (
                min(_values_of(records, "/off_policy/ratio/min", agent), default=math.nan),
                max(_values_of(records, "/off_policy/ratio/max", agent), default=math.nan),
            )
            for agent in agents_of(final)
        },
        "parity": first_step_parity(records),
    }


def first_step_parity(records: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """What the parity gate read at step 1, per agent (the engine's and the trainer's weights
    are the same there): mean and largest |trainer - engine| log-probability, ratio std."""
    first = next((r for r in records if r.get("step") == 1), {})
    figures: dict[str, dict[str, float]] = {}
    for key, value in first.items():
        parts = key.split("/")
        if parts[0] == "train" and parts[2:3] == ["off_policy"]:
            figures.setdefault(parts[1], {})["/".join(parts[3:])] = value
    return figures


def _sum_of(record: Mapping[str, Any], suffix: str) -> float:
    """A counter summed over agents (`rollout/<agent>/...`)."""
    return sum(v for k, v in record.items() if k.startswith("rollout/") and k.endswith(suffix))


def _values_of(
    records: Sequence[Mapping[str, Any]], suffix: str, agent: str | None = None
) -> list[float]:
    """Every step's value of a per-agent training metric (`train/<agent>/...`), of every agent
    or of one."""
    prefix = f"train/{agent}/" if agent else "train/"
    return [v for r in records for k, v in r.items() if k.startswith(prefix) and k.endswith(suffix)]


def _mean_of(records: Sequence[Mapping[str, Any]], suffix: str) -> float:
    values = _values_of(records, suffix)
    return statistics.fmean(values) if values else math.nan


def _seed_stderr(values: Sequence[float]) -> float:
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan


def variant_summary(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    agents = sorted(runs[0]["rise_per_agent"])
    rises = [r["rise"] for r in runs]
    return {
        "seeds": len(runs),
        "final_overall": statistics.fmean(r["final"]["overall"] for r in runs),
        "rise": statistics.fmean(rises),
        "rise_seed_stderr": _seed_stderr(rises),
        # A run's rise is one noisy figure of 256 rows: its row-level s.e., averaged over seeds.
        "rise_row_stderr": math.sqrt(sum(r["final_overall_stderr"] ** 2 for r in runs)) / len(runs),
        "seeds_rose": {a: sum(r["rise_per_agent"][a] > 0 for r in runs) for a in agents},
        "rise_per_agent": {
            a: statistics.fmean(r["rise_per_agent"][a] for r in runs) for a in agents
        },
        "train_min": statistics.fmean(r["train_min"] for r in runs),
        "rise_per_train_min": statistics.fmean(r["rise_per_train_min"] for r in runs),
        "episodes": statistics.fmean(r["episodes"] for r in runs),
        "uniform_dropped": statistics.fmean(r["uniform_dropped"] for r in runs),
        "masked_share": statistics.fmean(r["masked_share"] for r in runs),
        "capped_share": statistics.fmean(r["capped_share"] for r in runs),
    }


def seed_of(name: str) -> int:
    return int(name.rsplit("_seed", 1)[1])


def paired_against(
    baseline: Sequence[Mapping[str, Any]], runs: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """A variant's final overall reward minus the baseline's, seed by seed. Both runs of a seed
    draw their training rows from that seed and validate on the same rows from one start, so
    the difference cancels much of what the seed itself brings: its spread is the options' effect
    plus sampling noise, and is what tells two options apart on few seeds."""
    baseline_by_seed = {seed_of(r["run"]): r["final"]["overall"] for r in baseline}
    differences = [
        r["final"]["overall"] - baseline_by_seed[seed_of(r["run"])]
        for r in runs
        if seed_of(r["run"]) in baseline_by_seed
    ]
    return {
        "seeds": len(differences),
        "differences": differences,
        "mean": statistics.fmean(differences) if differences else math.nan,
        "stderr": _seed_stderr(differences),
    }


def format_tables(
    start: Mapping[str, float], runs: Mapping[str, list[dict[str, Any]]], summary: Mapping[str, Any]
) -> str:
    agents = agents_of(start)
    start_line = ", ".join(f"{a} {start[a]:.3f} ({start[a + '/stderr']:.3f})" for a in agents)
    lines = [
        f"start (greedy, before step 1): overall {start['overall']:.3f} "
        f"({overall_stderr(start):.3f}); {start_line}",
        "",
        "| run | final | rise | "
        + " | ".join(f"{a} rise" for a in agents)
        + " | train min | rise/min | episodes trained | uniform groups dropped (over budget) "
        "| masked share | capped share | exit |",
        "|---|---:|---:|" + "---:|" * len(agents) + "---:|---:|---:|---:|---:|---:|---:|",
    ]
    for variant_runs in runs.values():
        for r in variant_runs:
            lines.append(
                f"| {r['run']} | {r['final']['overall']:.3f} ({r['final_overall_stderr']:.3f}) "
                f"| {r['rise']:+.3f} | "
                + " | ".join(f"{r['rise_per_agent'][a]:+.3f}" for a in agents)
                + f" | {r['train_min']:.1f} | {r['rise_per_train_min']:+.4f} | {r['episodes']:.0f} "
                f"| {r['uniform_dropped']:.0f} ({r['uniform_over_budget']:.0f}) "
                f"| {r['masked_share']:.4f} | {r['capped_share']:.4f} | {r['exit_s']:.0f} s |"
            )
    lines += [
        "",
        "| variant | seeds | final | rise (seed s.e., row s.e.) | seeds rose per agent "
        "| rise per agent | train min | rise per train min |",
        "|---|---:|---:|---|---|---|---:|---:|",
    ]
    for variant, s in summary.items():
        rose = ", ".join(f"{a} {n}/{s['seeds']}" for a, n in s["seeds_rose"].items())
        per_agent = ", ".join(f"{a} {v:+.3f}" for a, v in s["rise_per_agent"].items())
        lines.append(
            f"| {variant} | {s['seeds']} | {s['final_overall']:.3f} | {s['rise']:+.3f} "
            f"({s['rise_seed_stderr']:.3f}, {s['rise_row_stderr']:.3f}) | {rose} | {per_agent} "
            f"| {s['train_min']:.1f} | {s['rise_per_train_min']:+.4f} |"
        )
    baseline = next(iter(runs), None)
    lines += [
        "",
        f"| variant | seeds paired with {baseline} | final minus {baseline}, per seed "
        "| mean (s.e.) |",
        "|---|---:|---|---:|",
    ]
    for variant, variant_runs in runs.items():
        if variant == baseline:
            continue
        paired = paired_against(runs[baseline], variant_runs)
        per_seed = ", ".join(f"{d:+.3f}" for d in paired["differences"])
        lines.append(
            f"| {variant} | {paired['seeds']} | {per_seed} "
            f"| {paired['mean']:+.3f} ({paired['stderr']:.3f}) |"
        )
    lines += [
        "",
        "| run | agent | step 1: mean \\|trainer - engine\\| | max | ratio std "
        "| every step: ratio min, max |",
        "|---|---|---:|---:|---:|---|",
    ]
    for variant_runs in runs.values():
        for r in variant_runs:
            for agent, p in sorted(r["parity"].items()):
                lines.append(
                    f"| {r['run']} | {agent} | {p['logprob_diff/mean']:.4f} "
                    f"| {p['logprob_diff/max']:.3f} | {p['ratio/std']:.4f} "
                    f"| {r['ratio_range'][agent][0]:.3f}, {r['ratio_range'][agent][1]:.3f} |"
                )
    return "\n".join(lines)


def draw(
    start: Mapping[str, float], runs: Mapping[str, list[dict[str, Any]]], output: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agents = agents_of(start)
    variants = list(runs)
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 5), constrained_layout=True)
    width = 0.8 / len(agents)
    for i, agent in enumerate(agents):
        colour = f"C{i}"
        left.axhline(start[agent], color=colour, linestyle=":", linewidth=1)
        for x, variant in enumerate(variants):
            values = [r["final"][agent] for r in runs[variant]]
            position = x - 0.4 + width * (i + 0.5)
            left.scatter([position] * len(values), values, color=colour, s=18, alpha=0.7)
            left.errorbar(
                position,
                statistics.fmean(values),
                yerr=_seed_stderr(values) if len(values) > 1 else 0.0,
                fmt="_",
                color=colour,
                markersize=16,
                capsize=4,
                label=agent if x == 0 else None,
            )
    left.set_xlim(-0.6, len(variants) - 0.4)
    left.set_xticks(range(len(variants)), variants, rotation=20, ha="right")
    left.set_ylabel("final validation reward (128 rows per agent, greedy)")
    left.set_title("final validation per seed (dots), mean and seed s.e.; start dotted")
    left.legend()
    for x, variant in enumerate(variants):
        minutes = [r["train_min"] for r in runs[variant]]
        rises = [r["rise"] for r in runs[variant]]
        colour = f"C{x + len(agents)}"
        right.scatter(minutes, rises, color=colour, s=22, label=variant)
        # The variant's mean rise per training minute, as a slope from the start.
        mean_min = statistics.fmean(minutes)
        right.plot([0, mean_min], [0, statistics.fmean(rises)], color=colour, linewidth=1)
    right.axhline(0, color="grey", linewidth=0.8)
    right.set_xlim(left=0)
    right.set_xlabel("training minutes (12 steps, validation passes left out)")
    right.set_ylabel("overall validation rise over the start")
    right.set_title("rise against training time per seed; lines: the variant's mean slope")
    right.legend(fontsize=8)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=110)
    print(f"[matrix] picture: {output}")


def summarise(variants: Sequence[str], seeds: Sequence[int], out: Path, picture: Path) -> None:
    start_name = start_run(matrix_runs_on_disk())
    if start_name is None:
        raise SystemExit("no run of the matrix validated before step 1: run the matrix first")
    start = validation_passes(read_metrics(start_name))[0]
    runs: dict[str, list[dict[str, Any]]] = {}
    for variant in variants:
        finished = [f for f in (run_figures(run_name(variant, s), start) for s in seeds) if f]
        if finished:
            runs[variant] = finished
    summary = {variant: variant_summary(variant_runs) for variant, variant_runs in runs.items()}
    print(format_tables(start, runs, summary))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"start": start, "runs": runs, "summary": summary}, indent=2) + "\n")
    print(f"[matrix] table: {out}")
    if runs:
        draw(start, runs, picture)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--summarise-only", action="store_true", help="run nothing, read outputs/")
    parser.add_argument("--rerun", action="store_true", help="run again runs that finished")
    parser.add_argument("--out", type=Path, default=OUTPUTS / "learn_matrix" / "table.json")
    parser.add_argument("--picture", type=Path, default=OUTPUTS / "learn_matrix" / "matrix.png")
    args = parser.parse_args()
    if not args.summarise_only:
        for seed in args.seeds:  # seed-major: a partial matrix still compares variants
            for variant in args.variants:
                name = run_name(variant, seed)
                if not args.rerun and (OUTPUTS / name / SIDECAR).exists():
                    print(f"[matrix] {name} ran already (--rerun runs it again)")
                    continue
                launch(variant, seed, validate_at_start=start_run(matrix_runs_on_disk()) is None)
    summarise(args.variants, args.seeds, args.out, args.picture)


if __name__ == "__main__":
    main()

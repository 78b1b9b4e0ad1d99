"""Where one step's rollout time goes: the torch engine's loop against the episodes it serves.

    python benchmarks/bench_rollout_timeline.py                       # the embedded default
    python benchmarks/bench_rollout_timeline.py --steps 2 -o t.png +experiment=learn \
        '~env.nemo_gym.agents.guess_number_agent'                     # any recipe overrides
    python benchmarks/bench_rollout_timeline.py --held-out 2 -o v.png +experiment=learn \
        '~env.nemo_gym.agents.guess_number_agent'                     # validation passes instead

Starts the run's own roles on a local Ray (`start_generation_server`, `start_gym_shards`, the
placement a run gets), then runs what one training step generates: `grpo.num_prompts_per_step`
groups of `grpo.num_generations_per_prompt` episodes of the training rows, all submitted at once
as the sync producer does, `--steps` times. With `--held-out N` it runs N validation passes
instead, as training validates: every held-out row once, greedy (`grpo.val_temperature`),
through the recipe's `Validator` inside the policy server's validation window.

The engine records every iteration of its loop (`EngineStep`: when; rows admitted, decoded,
queued and answered; seconds in prefill, in re-packing the batch's cache, in the decode step).
Prints, per step or pass, the wall time, the engine's busy share, its mean rows per decode step
and tokens per second (of wall time and of busy time), then what the window waited on
(`window_figures`): the engine's time by phase, its idle time while episodes were still running
(the agent loop: HTTP, the tool, the next request's rendering), the decode steps short of a full
batch and whether requests were queued for them, and the episode-seconds spent between turns.
Draws the rows decoding over time above each group's (or episode's) span.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from bench_roles import start_benchmark_generation
from matplotlib.ticker import MaxNLocator

from gymrl.cluster.ray_calls import wait_for
from gymrl.cluster.session import ClusterSession
from gymrl.config.compose import compose_raw
from gymrl.experience.held_out import Validator
from gymrl.experience.rows import RowStream, load_rows, load_validation_rows
from gymrl.generation.torch.engine import EngineCounters, EngineStep
from gymrl.model.policy import model_folder
from gymrl.preflight.validate import validate_config
from gymrl.roles.gym_shard import RayGroupRunner, start_gym_shards
from nemo_gym_ext.wire import agent_name_of


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=1, help="steps' worth of groups to run")
    parser.add_argument(
        "--held-out", type=int, default=0, help="validation passes to run instead of steps"
    )
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
        rows = load_rows(
            config.env.data,
            config.gym_shards,
            config.generation.sampling,
            config.run.seed,
            served_agents=shards,
            max_output_tokens=config.generation.server.max_tokens_per_turn,
        )
        runner = RayGroupRunner(shards)
        timeout_s = config.grpo.batch_timeout_s
        spans: list[tuple[float, float, int]] = []  # (submitted, finished, window) per group
        wait_for(generation.actor.record_engine_timeline.remote(), timeout_s=60, what="timeline")
        stream = RowStream(rows)
        first = time.monotonic()
        windows = args.held_out or args.steps
        for window in range(windows):
            before = wait_for(generation.actor.engine_counters.remote(), timeout_s=60, what="c")
            if args.held_out:
                spans.extend(_one_pass(config, rows, runner, generation, window))
            else:
                spans.extend(_one_step(config, stream, runner, timeout_s, window))
            after = wait_for(generation.actor.engine_counters.remote(), timeout_s=60, what="c")
            _report_counters(window, before, after)
        steps: list[EngineStep] = wait_for(
            generation.actor.engine_timeline.remote(), timeout_s=60, what="the timeline"
        )
    _report(steps, spans, windows, config.generation.max_batch_size)
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


class _TimedRunner:
    """A group runner that records when each group was submitted and seen finished."""

    def __init__(self, runner: RayGroupRunner, window: int):
        self._runner = runner
        self._window = window
        self._submitted: dict[Any, float] = {}
        self.spans: list[tuple[float, float, int]] = []

    @property
    def agents(self):
        return self._runner.agents

    def submit(self, agent: str, row: dict[str, Any], num_episodes: int) -> Any:
        handle = self._runner.submit(agent, row, num_episodes)
        self._submitted[handle] = time.monotonic()
        return handle

    def finished(self, running, timeout_s: float) -> list[Any]:
        done = self._runner.finished(running, timeout_s)
        now = time.monotonic()
        self.spans += [(self._submitted.pop(handle), now, self._window) for handle in done]
        return done

    def outcome(self, group: Any):
        return self._runner.outcome(group)

    def cancel(self, group: Any) -> None:
        self._runner.cancel(group)


def _one_pass(config, rows, runner, generation, window) -> list[tuple[float, float, int]]:
    """One validation pass as training runs it (`Training._validate`): the held-out rows through
    a `Validator`, inside the policy server's validation window."""
    grpo = config.grpo
    held_out = load_validation_rows(
        config.env.data,
        config.gym_shards,
        rows,
        temperature=grpo.val_temperature,
        top_p=config.generation.sampling.top_p,
        served_agents=runner.agents,
    )
    timed = _TimedRunner(runner, window)
    validator = Validator(
        held_out,
        timed,
        grpo.batch_timeout_s,
        max_refused_share=config.env.data.max_refused_held_out_share,
    )
    wait_for(generation.actor.set_validating.remote(True), timeout_s=60, what="validating")
    try:
        metrics = validator.run()
    finally:
        wait_for(generation.actor.set_validating.remote(False), timeout_s=60, what="validating")
    print(f"pass {window}: reward {metrics['validation/reward/mean']:.3f}")
    return timed.spans


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


def _report(
    steps: list[EngineStep], spans: list[tuple[float, float, int]], count: int, max_rows: int
) -> None:
    for window in range(count):
        mine = [span for span in spans if span[2] == window]
        start, end = min(s for s, _, _ in mine), max(e for _, e, _ in mine)
        inside = [s for s in steps if start <= s.start_s <= end]
        busy = sum(s.end_s - s.start_s for s in inside)
        decodes = [s.decoded_rows for s in inside if s.decoded_rows]
        tokens = sum(s.admitted + s.decoded_rows for s in inside)
        wall = end - start
        admitting = sum(s.end_s - s.start_s for s in inside if s.admitted)
        print(
            f"window {window}: {wall:.1f} s, engine busy {busy / wall:.0%}, "
            f"{sum(decodes) / max(len(decodes), 1):.1f} rows per decode step, "
            f"{tokens / wall:.1f} tokens/s of wall time, "
            f"{tokens / max(busy, 1e-9):.1f} per busy s, "
            f"{admitting:.1f} s in iterations that prefilled"
        )
        figures = window_figures(inside, [(s, e) for s, e, _ in mine], max_rows)
        print("  " + ", ".join(f"{key} {value:.3g}" for key, value in figures.items()))


def window_figures(
    steps: Sequence[EngineStep], spans: Sequence[tuple[float, float]], max_rows: int
) -> dict[str, float]:
    """What a window (a step's rollout, a validation pass) waited on, from the engine's
    iterations in it and its groups' spans (submitted, finished):

    * `wall_s`; the engine's `prefill_s`, `rebuild_s` (re-packing the batch's cache) and
      `decode_s`; `idle_s`, the engine idle while a group still ran (its episodes were all
      between turns: the agent loop);
    * `decode_steps`, `rows_per_decode_step`, `full_step_share` (steps at `max_rows`), and
      `short_queue_empty_share`: steps short of `max_rows` with no request queued at their end
      (the batch was short for want of requests, not of slots);
    * `prefill_iterations` (iterations that admitted rows) and `requests` (rows admitted);
      `rebuilds`, the iterations whose batch changed (rows joined, or left in the one before),
      each of which re-lays the batch's cache (`_DecodeBatch.rebuild`);
    * `between_turns_row_s`: episode-seconds outside the engine (group spans alive minus rows
      decoding or queued, over each iteration and each idle gap), and per request
      `between_turns_s_per_request`: the agent loop's latency as the engine sees it (one group
      per episode in a validation pass; for a training step's groups of several episodes, the
      spans count groups and this undercounts);
    * `forwards`: decode steps plus prefill iterations, what the pass costs where a forward
      pass costs the same whatever its rows (memory-bound decoding).
    """
    start, end = min(s for s, _ in spans), max(e for _, e in spans)

    def alive(at: float) -> int:
        return sum(1 for s, e in spans if s <= at < e)

    ordered = sorted(steps, key=lambda s: s.start_s)
    idle = between = 0.0
    previous_end, left_in_batch = start, 0
    for step in ordered:
        gap = step.start_s - previous_end
        if gap > 0:
            outside = max(alive((previous_end + step.start_s) / 2) - left_in_batch, 0)
            between += outside * gap
            if left_in_batch == 0:
                idle += gap
        inside = step.decoded_rows + step.waiting
        outside = max(alive((step.start_s + step.end_s) / 2) - inside, 0)
        between += outside * (step.end_s - step.start_s)
        previous_end = step.end_s
        left_in_batch = max(step.decoded_rows - step.answered, 0) + step.waiting
    if end > previous_end:
        between += max(alive((previous_end + end) / 2) - left_in_batch, 0) * (end - previous_end)
        if left_in_batch == 0:
            idle += end - previous_end
    decodes = [s for s in ordered if s.decoded_rows]
    short = [s for s in decodes if s.decoded_rows < max_rows]
    requests = sum(s.admitted for s in ordered)
    prefills = sum(1 for s in ordered if s.admitted)
    rebuilds = sum(
        1
        for before, step in zip([None, *ordered], ordered, strict=False)
        if step.admitted or (before is not None and before.answered)
    )
    return {
        "wall_s": end - start,
        "prefill_s": sum(s.prefill_s for s in ordered),
        "rebuild_s": sum(s.rebuild_s for s in ordered),
        "decode_s": sum(s.decode_s for s in ordered),
        "idle_s": idle,
        "decode_steps": float(len(decodes)),
        "rows_per_decode_step": (
            sum(s.decoded_rows for s in decodes) / len(decodes) if decodes else math.nan
        ),
        "full_step_share": (len(decodes) - len(short)) / len(decodes) if decodes else math.nan,
        "short_queue_empty_share": (
            sum(1 for s in short if s.waiting == 0) / len(short) if short else math.nan
        ),
        "prefill_iterations": float(prefills),
        "requests": float(requests),
        "rebuilds": float(rebuilds),
        "between_turns_row_s": between,
        "between_turns_s_per_request": between / requests if requests else math.nan,
        "forwards": float(len(decodes) + prefills),
    }


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
    groups_axis.set_title("GRPO groups (a validation pass: one per episode), submission to outcome")
    figure.tight_layout()
    figure.savefig(output, dpi=110)


if __name__ == "__main__":
    main()

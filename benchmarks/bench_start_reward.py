"""Starting validation reward per agent: the held-out rows a run would validate on, one episode
each with the starting weights, at the run's validation sampling, through the evaluation path
(`gymrl.recipes.evaluation.EvalRecipe`: the roles a run starts, minus the trainer, and validation's
own pass and reduction).

    python benchmarks/bench_start_reward.py --rows 128                       # the default run
    python benchmarks/bench_start_reward.py --rows 128 +experiment=learn     # any recipe overrides
    python benchmarks/bench_start_reward.py --rows 16 --show 3               # print 3 transcripts

`--rows` sets env.data.num_builtin_val_rows_per_agent; sampling is `grpo.val_temperature` (greedy
by default). Prints each agent's mean reward with its standard error and the other per-agent
means, and the wall time of the pass. For k samples per row and pass@k use recipes/eval.py.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from gymrl.config.compose import compose_raw
from gymrl.preflight.validate import validate_config
from gymrl.recipes.evaluation import EvalRecipe
from gymrl.run.eval_folder import EPISODES_FILENAME


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=128, help="held-out rows per agent")
    parser.add_argument("--show", type=int, default=0, help="transcripts to print per agent")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, e.g. +experiment=learn")
    args = parser.parse_args()
    raw = compose_raw(args.overrides)
    temperature = raw["grpo"]["val_temperature"]
    with tempfile.TemporaryDirectory(prefix="start_reward_") as scratch:
        config = validate_config(
            compose_raw(
                [
                    *args.overrides,
                    f"env.data.num_builtin_val_rows_per_agent={args.rows}",
                    "eval.num_samples=1",
                    "eval.pass_at_k=[1]",
                    f"eval.temperature={temperature}",
                    f"eval.transcripts={str(args.show > 0).lower()}",
                    f"eval.output_dir={scratch}/eval",
                ]
            )
        )
        recipe = EvalRecipe(config, Path(scratch))
        started = time.monotonic()
        try:
            recipe.setup()
            summary = recipe.evaluate()
        finally:
            recipe.cleanup()
        total_s = time.monotonic() - started
        episodes = _read_episodes(Path(scratch) / "eval" / EPISODES_FILENAME)
    metrics = summary["metrics"]
    print(f"{summary['rows']} rows: pass {summary['wall_s']:.0f} s, with start-up {total_s:.0f} s")
    for key in sorted(metrics):
        if key.endswith(("/mean", "/stderr", "episodes", "failures")):
            print(f"  {key} = {_number(metrics[key])}")
    _show(episodes, args.show)
    if args.json:
        results = {"wall_s": summary["wall_s"], "metrics": metrics}
        args.json.write_text(json.dumps(results, indent=1))


def _read_episodes(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _show(episodes: list[dict[str, Any]], per_agent: int) -> None:
    shown: dict[str, int] = {}
    for episode in episodes:
        agent = episode["agent"]
        if "transcript" in episode and shown.get(agent, 0) < per_agent:
            shown[agent] = shown.get(agent, 0) + 1
            print(f"--- {agent} row {episode['row_id']} reward {episode['reward']}")
            for item in episode["transcript"]:
                print("   ", _describe(item))


def _describe(item: dict[str, Any]) -> str:
    kind = item.get("type", item.get("role"))
    if kind == "function_call":
        return f"call {item['name']}({item['arguments']})"
    if kind == "function_call_output":
        return f"tool -> {item['output']!r}"
    content = item.get("content")
    if isinstance(content, list):
        content = " ".join(part.get("text", "") for part in content if isinstance(part, dict))
    return f"{item.get('role', kind)}: {content!r}"


def _number(value: float | None) -> str:
    return "nan" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    main()

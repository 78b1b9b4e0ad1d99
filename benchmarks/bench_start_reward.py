"""Starting validation reward per agent: the held-out rows a run would validate on, one episode
each with the starting weights, through the real policy server, agents and postprocessor, in one
process (no Ray, no trainer).

    python benchmarks/bench_start_reward.py --rows 128                       # the default run
    python benchmarks/bench_start_reward.py --rows 128 +experiment=learn     # any recipe overrides
    python benchmarks/bench_start_reward.py --rows 16 --show 3               # print 3 transcripts

`--rows` sets env.data.num_builtin_val_rows_per_agent; sampling is the run's validation sampling
(`grpo.val_temperature`, greedy by default). Prints mean reward, its standard error and the other
per-agent means, and the wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from gymrl.config.compose import compose_raw
from gymrl.experience.producer import scalar_fields
from gymrl.experience.rows import load_rows, load_validation_rows
from gymrl.experience.validation import validation_metrics
from gymrl.generation.api_key import resolve_api_key
from gymrl.generation.chat_template import ChatFormat
from gymrl.generation.policy_server import create_policy_server_app
from gymrl.generation.torch_engine import TorchGenerationEngine
from gymrl.model.policy import build_policy
from gymrl.model.tokens import decode_text, eos_token_id
from gymrl.preflight.validate import validate_config
from nemo_gym_ext.envs.registry import start_builtin_environment
from nemo_gym_ext.http_server import serve_in_thread
from nemo_gym_ext.rollout import RolloutCollector, RolloutSettings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=128, help="held-out rows per agent")
    parser.add_argument("--show", type=int, default=0, help="transcripts to print per agent")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, e.g. +experiment=learn")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    overrides = [*args.overrides, f"env.data.num_builtin_val_rows_per_agent={args.rows}"]
    config = validate_config(compose_raw(overrides))
    actors = config.gym_shards
    grpo, data = config.grpo, config.env.data
    train_rows = load_rows(
        data,
        actors,
        config.generation.sampling,
        config.run.seed,
        served_agents={name for actor in actors for name in actor.agents},
        max_output_tokens=config.generation.server.max_tokens_per_turn,
    )
    rows = load_validation_rows(
        data,
        actors,
        train_rows,
        temperature=grpo.val_temperature,
        top_p=config.generation.sampling.top_p,
    )
    started = time.monotonic()
    results, failures = asyncio.run(_run(config, actors, rows))
    wall_s = time.monotonic() - started
    metrics = validation_metrics([scalar_fields(r) for r in results], failures)
    print(f"{len(rows)} rows, {wall_s:.0f} s, overrides {args.overrides}")
    for key in sorted(metrics):
        if key.endswith(("/mean", "/stderr", "episodes", "failures")):
            print(f"  {key} = {metrics[key]:.3f}")
    shown: dict[str, int] = {}
    for result in results:
        agent = result["agent_ref"]["name"]
        if shown.get(agent, 0) < args.show:
            shown[agent] = shown.get(agent, 0) + 1
            print(f"--- {agent} reward {result['reward']}")
            for item in result["response"]["output"]:
                print("   ", _describe(item))
    if args.json:
        args.json.write_text(json.dumps({"wall_s": wall_s, "metrics": metrics}, indent=1))


async def _run(config, actors, rows) -> tuple[list[dict[str, Any]], int]:
    api_key = resolve_api_key(None)
    model, tokenizer = build_policy(config.policy, config.run.seed)
    generation = config.generation
    engine = TorchGenerationEngine(
        model,
        max_batch_size=generation.max_batch_size,
        eos_token_ids=[eos_token_id(tokenizer)],
        seed=config.run.seed,
        compute_dtype=config.policy.compute_dtype,
    )
    server = generation.server
    app = create_policy_server_app(
        engine,
        ChatFormat.from_policy(config.policy, tokenizer),
        model_name=config.policy.name,
        api_key=api_key,
        honor_prompt_token_ids=server.honor_prompt_token_ids,
        default_max_tokens=server.max_tokens_per_turn,
        max_context_tokens=config.policy.max_total_sequence_length,
        request_timeout_s=server.request_timeout_s,
    )
    with serve_in_thread(app) as policy:
        environments, urls = [], {}
        for actor in actors:
            for name, spec in actor.agents.items():
                env = start_builtin_environment(
                    spec.environment,
                    agent_name=name,
                    policy_base_url=f"{policy.url}/v1",
                    policy_api_key=api_key.get_secret_value(),
                    options=spec.agent_options(policy_model=config.policy.name),
                )
                environments.append(env)
                urls[name] = env.agent_url
        rollout = config.env.rollout
        collector = RolloutCollector(
            urls,
            actors[0].postprocess,
            RolloutSettings(
                max_concurrent_rollouts=generation.max_batch_size,
                run_timeout_s=rollout.run_timeout_s,
                max_retries=rollout.max_retries,
                max_result_bytes=rollout.max_result_bytes,
                retry_backoff_s=rollout.retry_backoff_s,
                retry_backoff_max_s=rollout.retry_backoff_max_s,
            ),
            vocab_size=len(tokenizer),
            decode=partial(decode_text, tokenizer, skip_special_tokens=False),
        )
        try:
            outcomes = await asyncio.gather(*(collector.run_group(row, 1) for row in rows))
        finally:
            await collector.aclose()
            for env in environments:
                env.close()
    results = [episode["full_result"] for o in outcomes for episode in o.episodes]
    failures = [cause for o in outcomes for cause in o.failures]
    if failures:
        print(f"{len(failures)} episodes failed; the last: {failures[-1]}")
    return results, len(failures)


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


if __name__ == "__main__":
    main()

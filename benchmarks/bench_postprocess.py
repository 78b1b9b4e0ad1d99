"""Benchmark the Gym postprocessor against a plain list-slice contiguity walk.

The project's requirement: `postprocess_gym_result` costs at most 3x a plain
walk that builds `seen` and checks `prompt[:len(seen)] == seen` for every trainable turn. The
episode is SWE-like: 200 model calls whose prompts repeat the whole history (the final prompt is
about 64k tokens), ~200-token deltas, ~120-token generations, ids drawn uniformly from a 49152-id
vocabulary (so almost none are CPython's cached small ints), and reasoning and
function_call_output items between turns. It is serialised to JSON and parsed back, so every id
is a fresh int from `json.loads`, as in production; the parse itself is timed too.

Classification is timed too (issue 20): case (g) is case (c) with SmolLM2's decode, so the
divergence's cause is decided on text (only a divergent turn pays for it; the contiguous cases
(b) and (d) must stay where they were).

Cases run interleaved, one repeat of each in turn, so machine drift hits them alike.

Ingest is timed too (issue 22: ingest plus postprocessing within 0.3 s): the result as the agent
now writes it (orjson) parsed by `loads_result` (nemo_gym_ext/result_json.py, which reuses the
ints of repeated prompt prefixes), then postprocessed, against `orjson.loads` and `json.loads`.

    python benchmarks/bench_postprocess.py                 # defaults: 200 turns, ~64k tokens
    python benchmarks/bench_postprocess.py --profile       # add a cProfile of case (b)
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import random
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import orjson

from gymrl.config.schema.policy import PolicyConfig
from gymrl.model.loading import ensure_smollm2_checkpoint, load_tokenizer
from gymrl.model.tokens import decode_text
from nemo_gym_ext.config import NemoGymPostprocessConfig
from nemo_gym_ext.postprocess import NonContiguousEpisodeError, postprocess_gym_result
from nemo_gym_ext.result_json import loads_result

VOCAB_SIZE = 49152
REQUIRED_RATIO = 3.0
REQUIRED_INGEST_S = 0.3
SMOLLM2_CACHE_DIR = PolicyConfig.model_fields["model_cache_dir"].default


def build_swe_episode(
    *, turns: int, delta_tokens: int, generation_tokens: int, divergent_turn: int | None, seed: int
) -> dict[str, Any]:
    """A Gym result of `turns` model calls; deltas and generations vary +-50% around the means.

    With `divergent_turn`, the server's history is re-tokenised at its middle before that turn's
    prompt is formed, and every later prompt continues from the altered history.
    """
    rng = random.Random(seed)

    def ids(mean: int) -> list[int]:
        return [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(mean // 2, mean * 3 // 2))]

    output: list[dict[str, Any]] = []
    history: list[int] = []
    for turn in range(turns):
        if turn == divergent_turn:
            middle = len(history) // 2
            history = [
                *history[:middle],
                (history[middle] + 1) % VOCAB_SIZE,
                *history[middle + 1 :],
            ]
        if turn:
            output.append(
                {
                    "type": "function_call_output",
                    "call_id": f"call_{turn - 1}",
                    "output": "FAILED tests/test_models.py::test_save - AssertionError\n" * 4,
                }
            )
        prompt = history + ids(delta_tokens)
        generation = ids(generation_tokens)
        output.append({"type": "reasoning", "summary": [{"type": "summary_text", "text": "..."}]})
        output.append(
            {
                "type": "function_call",
                "call_id": f"call_{turn}",
                "name": "bash",
                "arguments": '{"command": "pytest -x tests/test_models.py"}',
                "prompt_token_ids": prompt,
                "generation_token_ids": generation,
                "generation_log_probs": [round(-rng.expovariate(4.0), 6) for _ in generation],
            }
        )
        history = prompt + generation
    return {
        "id": "django__django-11099",
        "agent_ref": {"type": "responses_api_agents", "name": "swe_agent"},
        "responses_create_params": {"input": [{"role": "user", "content": "Fix the bug."}]},
        "response": {"id": "resp_0", "output": output},
        "reward": 1.0,
    }


def plain_walk(result: dict[str, Any]) -> list[int]:
    """The baseline: build `seen` and compare a list slice of every trainable turn's prompt."""
    seen: list[int] = []
    for item in result["response"]["output"]:
        generation = item.get("generation_token_ids")
        if not generation:
            continue
        prompt = item["prompt_token_ids"]
        if prompt[: len(seen)] != seen:
            raise AssertionError("non-contiguous")
        seen.extend(prompt[len(seen) :])
        seen.extend(generation)
    return seen


def expect_divergence(call: Callable[[], Any]) -> Callable[[], None]:
    def run() -> None:
        try:
            call()
        except NonContiguousEpisodeError:
            return
        raise AssertionError("the divergent episode did not raise")

    return run


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--delta-tokens", type=int, default=200)
    parser.add_argument("--generation-tokens", type=int, default=120)
    parser.add_argument("--divergent-turn", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json-repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="cProfile case (b) afterwards")
    args = parser.parse_args()
    if not 1 <= args.divergent_turn < args.turns:
        parser.error(f"--divergent-turn must lie in [1, {args.turns}), got {args.divergent_turn}")

    shape = {
        "turns": args.turns,
        "delta_tokens": args.delta_tokens,
        "generation_tokens": args.generation_tokens,
        "seed": args.seed,
    }
    texts = {
        "contiguous": json.dumps(build_swe_episode(divergent_turn=None, **shape)),
        "divergent": json.dumps(build_swe_episode(divergent_turn=args.divergent_turn, **shape)),
    }
    wire = orjson.dumps(json.loads(texts["contiguous"]))
    parsers: dict[str, Callable[[], Any]] = {
        "json.loads": lambda: json.loads(texts["contiguous"]),
        "orjson.loads": lambda: orjson.loads(wire),
        "loads_result": lambda: loads_result(wire),
    }
    parse_samples: dict[str, list[float]] = {name: [] for name in parsers}
    for _ in range(args.json_repeats):
        for name, parse in parsers.items():
            start = time.perf_counter()
            parse()
            parse_samples[name].append(time.perf_counter() - start)
    loads_samples = parse_samples["json.loads"]
    contiguous = json.loads(texts["contiguous"])
    divergent = json.loads(texts["divergent"])
    row = {key: contiguous[key] for key in ("id", "agent_ref", "responses_create_params")}
    items = [i for i in contiguous["response"]["output"] if i.get("generation_token_ids")]
    total_ids = sum(len(i["prompt_token_ids"]) + len(i["generation_token_ids"]) for i in items)

    tokenizer = load_tokenizer(ensure_smollm2_checkpoint(SMOLLM2_CACHE_DIR))
    decode = partial(decode_text, tokenizer, skip_special_tokens=False)
    strict = NemoGymPostprocessConfig()
    truncate = NemoGymPostprocessConfig(truncate_noncontiguous_episodes=True)
    cases: dict[str, Callable[[], Any]] = {
        "(a) plain list-slice walk": lambda: plain_walk(contiguous),
        "(b) postprocess, truncation off": lambda: postprocess_gym_result(row, contiguous, strict),
        f"(c) truncation on, diverges at turn {args.divergent_turn}": lambda: (
            postprocess_gym_result(row, divergent, truncate)
        ),
        "(d) truncation off + vocab_size checks": lambda: postprocess_gym_result(
            row, contiguous, strict, vocab_size=VOCAB_SIZE
        ),
        f"(e) truncation off, diverges at turn {args.divergent_turn} (raises)": expect_divergence(
            lambda: postprocess_gym_result(row, divergent, strict)
        ),
        "(f) ingest: loads_result of the orjson bytes + (b)": lambda: postprocess_gym_result(
            row, loads_result(wire), strict
        ),
        "(g) (c) + SmolLM2 decode: the cause decided on text": lambda: postprocess_gym_result(
            row, divergent, truncate, decode=decode
        ),
    }
    kept = postprocess_gym_result(row, divergent, truncate).full_result
    assert kept["noncontiguous_dropped_turns"] == args.turns - args.divergent_turn

    samples: dict[str, list[float]] = {name: [] for name in cases}
    for call in cases.values():  # warm-up
        call()
    for _ in range(args.repeats):
        for name, call in cases.items():
            start = time.perf_counter()
            call()
            samples[name].append(time.perf_counter() - start)

    print(f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs")
    print(
        f"episode: {args.turns} trainable turns, final prompt {len(items[-1]['prompt_token_ids'])} "
        f"tokens, {total_ids / 1e6:.2f} M ids in all prompts and generations, "
        f"JSON {len(texts['contiguous']) / 1e6:.1f} MB"
    )
    print(
        f"json.loads: median {median_ms(loads_samples):.0f} ms over {args.json_repeats} runs "
        "(for scale: what the walk adds to parsing the result)"
    )
    for name, values in parse_samples.items():
        print(
            f"  {name:<14} median {median_ms(values):6.0f} ms "
            f"(orjson bytes {len(wire) / 1e6:.1f} MB)"
        )
    print(f"median of {args.repeats} interleaved runs after one warm-up:")
    baseline = median_ms(samples["(a) plain list-slice walk"])
    for name, values in samples.items():
        ms = median_ms(values)
        print(f"  {name:<58} {ms:8.1f} ms  (min {min(values) * 1e3:7.1f})  {ms / baseline:5.2f}x")
    worst = max(median_ms(samples[name]) for name in list(cases)[1:4]) / baseline
    verdict = "met" if worst <= REQUIRED_RATIO else "NOT met"
    print(f"requirement postprocess <= {REQUIRED_RATIO:g}x plain walk, cases (b)-(d): {verdict}")
    ingest_s = median_ms(samples["(f) ingest: loads_result of the orjson bytes + (b)"]) / 1e3
    ingest_met = ingest_s <= REQUIRED_INGEST_S
    print(
        f"requirement ingest + postprocess <= {REQUIRED_INGEST_S} s, case (f): "
        f"{'met' if ingest_met else 'NOT met'}"
    )

    if args.profile:
        profiler = cProfile.Profile()
        profiler.runcall(cases["(b) postprocess, truncation off"])
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("cumulative").print_stats(12)
    return 0 if worst <= REQUIRED_RATIO and ingest_met else 1


if __name__ == "__main__":
    sys.exit(main())

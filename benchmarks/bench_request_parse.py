"""Benchmark how long the policy server takes to parse and validate a SWE-shaped request.

Gym's `vllm_model` adapter sends, on every model call, every earlier assistant turn with its own
token bundle (`prompt_token_ids` holding the whole history before it), so a request's body grows
quadratically with the turn. The request at turn N of a 200-call SWE episode (the episode of
`bench_postprocess.py`: ~200-token deltas, ~120-token generations) is built, serialised with
`json.dumps` as httpx sends it, and parsed by:

* `orjson.loads` and `json.loads`: the floor, parsing alone;
* `json.loads` + `PolicyServerRequest.model_validate`: what FastAPI did with a typed body (on a
  checkout before issue 22 this includes the walk that looked for lone surrogates);
* `parse_json_body`: what the server does now (pydantic-core's parser and validation in one pass),
  when the checkout has it.

The requirement (issue 22): the server's parse costs at most 3x `orjson.loads` of the same bytes.

    python benchmarks/bench_request_parse.py                     # turns 10, 50, 200
    PYTHONPATH=<older checkout> python benchmarks/bench_request_parse.py   # the "before" figures
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import orjson
from bench_postprocess import build_swe_episode

from gymrl.generation.server.app import PolicyServerRequest
from nemo_gym_ext.wire import items_to_chat_messages

try:
    from nemo_gym_ext.json_body import parse_json_body
except ImportError:  # a checkout from before issue 22
    parse_json_body = None

REQUIRED_RATIO = 3.0
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a command.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]


def swe_request(turns: int, seed: int) -> bytes:
    """The body of the model call that starts turn `turns` + 1 of the episode."""
    episode = build_swe_episode(
        turns=turns, delta_tokens=200, generation_tokens=120, divergent_turn=None, seed=seed
    )
    items = [i for i in episode["response"]["output"] if i["type"] != "reasoning"]
    items.append({"type": "function_call_output", "call_id": f"call_{turns - 1}", "output": "ok"})
    prompt = [{"type": "message", "role": "user", "content": "Fix the bug."}]
    body: dict[str, Any] = {
        "model": "policy",
        "messages": items_to_chat_messages([*prompt, *items], include_token_ids=True),
        "tools": TOOLS,
        "temperature": 1.0,
        "top_p": 1.0,
        "logprobs": True,
        "top_logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    return json.dumps(body).encode()


def median_ms(call: Callable[[], Any], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[10, 50, 200])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    print(f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs")
    worst = 0.0
    for turns in args.turns:
        raw = swe_request(turns, args.seed)
        cases: dict[str, Callable[[], Any]] = {
            "orjson.loads": lambda raw=raw: orjson.loads(raw),
            "json.loads": lambda raw=raw: json.loads(raw),
            "json.loads + model_validate": lambda raw=raw: PolicyServerRequest.model_validate(
                json.loads(raw)
            ),
        }
        if parse_json_body is not None:
            cases["parse_json_body (the server)"] = lambda raw=raw, parse=parse_json_body: parse(
                raw, PolicyServerRequest
            )
        figures = {name: median_ms(call, args.repeats) for name, call in cases.items()}
        floor = figures["orjson.loads"]
        print(f"turn {turns}: body {len(raw) / 1e6:.2f} MB, median of {args.repeats}")
        for name, ms in figures.items():
            print(f"  {name:<32} {ms:9.2f} ms  {ms / floor:5.2f}x orjson.loads")
        server = figures.get("parse_json_body (the server)", figures["json.loads + model_validate"])
        worst = max(worst, server / floor)
    verdict = "met" if worst <= REQUIRED_RATIO else "NOT met"
    print(f"requirement: the server's parse <= {REQUIRED_RATIO:g}x orjson.loads: {verdict}")
    return 0 if worst <= REQUIRED_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())

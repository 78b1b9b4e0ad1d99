"""Turns per second and prefix-cache hit rate of long multi-turn episodes over SGLang stand-ins,
least-loaded vs cache-aware routing (`gymrl.generation.sglang.routing`).

Each episode is a thread that calls `SGLangEngine.generate` once per turn; a turn's prompt is the
previous prompt, the previous answer and a new user message, as in a SWE agent's episode. The
stand-in servers (`tests/support/sglang_standin/`) sleep `prefill_us` per prompt token
their prefix cache does not hold and `decode_ms` per generated token, and report
`cached_tokens`; a server's load does not slow it down (the stand-in has no shared GPU), so the
figures isolate what routing does to cache hits.

    python benchmarks/bench_routing.py                     # 8 episodes x 200 turns on 4 servers
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test helper's root

from gymrl.generation.sglang.engine import SGLangEngine
from gymrl.generation.sglang.routing import Routing
from gymrl.generation.types import GenerationRequest, SamplingParams
from nemo_gym_ext.http_server import serve_in_thread
from tests.support.sglang_standin import make_standin  # a test helper


def run(routing: Routing, args: argparse.Namespace) -> dict[str, float]:
    standins = [
        make_standin(
            context_length=1 << 20,
            token_delay_s=args.decode_ms / 1000,
            prefill_s_per_token=args.prefill_us / 1e6,
        )
        for _ in range(args.servers)
    ]
    servers = [serve_in_thread(app) for app, _ in standins]
    errors: list[BaseException] = []
    try:
        with SGLangEngine(
            [server.url for server in servers],
            request_timeout_s=600.0,
            refit_timeout_s=60.0,
            routing=routing,
        ) as engine:

            def episode(index: int) -> None:
                try:
                    prompt = [index * 1_000_003 % 40_000 + i for i in range(args.system)]
                    for turn in range(args.turns):
                        request = GenerationRequest(prompt, SamplingParams(args.out))
                        [out] = engine.generate([request])
                        delta = [(index * 7919 + turn * 104729 + i) % 40_000 for i in range(40)]
                        prompt = prompt + out.token_ids + delta[: args.delta]
                except BaseException as error:  # reported after the run
                    errors.append(error)

            threads = [threading.Thread(target=episode, args=(i,)) for i in range(args.episodes)]
            start = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            elapsed = time.perf_counter() - start
    finally:
        for server in servers:
            server.close()
    if errors:
        raise errors[0]
    states = [state for _, state in standins]
    prompt_tokens = sum(state.prompt_tokens for state in states)
    return {
        "turns_per_s": args.episodes * args.turns / elapsed,
        "hit_rate": sum(state.cached_tokens for state in states) / prompt_tokens,
        "seconds": elapsed,
        "prefilled_tokens": prompt_tokens - sum(state.cached_tokens for state in states),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--system", type=int, default=400, help="first prompt's tokens")
    parser.add_argument("--delta", type=int, default=40, help="new user tokens per turn")
    parser.add_argument("--out", type=int, default=16, help="generated tokens per turn")
    parser.add_argument("--prefill-us", type=float, default=50.0, help="per uncached token")
    parser.add_argument("--decode-ms", type=float, default=5.0, help="per generated token")
    parser.add_argument("--repeats", type=int, default=1, help="rounds, the two modes in turn")
    args = parser.parse_args()
    print(f"{args}")
    print("| routing | turns/s | prefix-cache hit rate | tokens prefilled | wall s |")
    print("|---|---|---|---|---|")
    modes: list[Routing] = ["least_loaded", "cache_aware"]
    for routing in modes * args.repeats:
        result = run(routing, args)
        print(
            f"| {routing} | {result['turns_per_s']:.1f} | {result['hit_rate']:.1%} | "
            f"{result['prefilled_tokens']:,} | {result['seconds']:.1f} |"
        )


if __name__ == "__main__":
    main()

"""256 concurrent loopback clients against the policy server with the torch engine (a tiny
model, one request each): every request answered once, to the right caller, well-formed.

The checks are `benchmarks/bench_policy_server_load.py`'s own (`run_load`), loaded from its
file, so the benchmark that produces the load figures is the one tested here.
"""

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_policy_server_load.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_policy_server_load", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_256_concurrent_clients_each_get_their_own_answer(bench):
    cache_dir = Path(bench.MODEL_CACHE_DIR).expanduser()
    server, tokenizer = bench.serve_policy("tiny", threads=2, cache_dir=cache_dir)
    with server:
        report = asyncio.run(
            bench.run_load(f"{server.url}/v1", tokenizer, clients=256, duration_s=0.0, max_tokens=4)
        )
    assert report.failures == []
    assert report.requests == report.answered == 256
    assert report.duplicate_ids == 0
    assert report.generated_tokens > 0

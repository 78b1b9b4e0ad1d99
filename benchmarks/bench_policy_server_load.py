"""The policy server under load: N concurrent loopback clients, the torch engine, a bounded time.

The clients run in a process of their own (asyncio's loop, httpx), so that they take neither the
server's GIL nor its event loop: what is measured is the server. Each client loops until the
deadline, sending a chat completion whose user message carries a nonce unique to the request
(`client-<c>-request-<i>`). Every answer is checked: HTTP 200, a full `ChatCompletion`, a token
bundle of consistent lengths, and a prompt that decodes to the client's own nonce (no answer
delivered to the wrong caller); every completion id must be unique (none duplicated) and every
request must get exactly one answer (none lost). The server process's resident memory is sampled
every half second, to see that it stays bounded over the run, and its CPU time is reported per
answered request: what the server itself spends, apart from the time it waits for a core.

    python benchmarks/bench_policy_server_load.py        # SmolLM2-135M, 256 clients, 60 s
    python benchmarks/bench_policy_server_load.py --model tiny --duration-s 20
    python benchmarks/bench_policy_server_load.py --model tiny --loop asyncio --http h11

The engine runs with the schema's defaults (`TorchGenerationConfig`), so the bench measures what a
run serves; `--max-batch-size` overrides the batch, as `generation.max_batch_size` does.

`--loop` and `--http` choose uvicorn's event loop and HTTP parser for the server (default: what
every server of the project gets, uvicorn's "auto": uvloop and httptools where they import).

`tests/gymrl/generation/server/test_app_load.py` runs this script for one round of 256 clients
on a tiny model, so the checks themselves are tested.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import multiprocessing
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import torch
from pydantic import SecretStr

from gymrl.config.schema.generation import TorchGenerationConfig
from gymrl.config.schema.policy import PolicyConfig
from gymrl.generation.server.app import create_policy_server_app
from gymrl.generation.server.chat_template import ChatFormat
from gymrl.generation.server.parsers import GenerationParser
from gymrl.generation.torch.engine import TorchGenerationEngine
from gymrl.model.loading import (
    build_tiny_llama,
    ensure_smollm2_checkpoint,
    load_pretrained,
    load_tokenizer,
)
from gymrl.model.tokens import eos_token_id
from nemo_gym_ext.http_server import serve_in_thread

KEY = "load-test"
MODEL_CACHE_DIR = PolicyConfig.model_fields["model_cache_dir"].default
GENERATION = TorchGenerationConfig()  # the schema's defaults
MODEL = "policy"
SERVER_DEFAULTS = inspect.signature(serve_in_thread).parameters


@dataclass
class LoadReport:
    requests: int = 0
    answered: int = 0
    failures: list[str] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)
    generated_tokens: int = 0
    duplicate_ids: int = 0
    wall_s: float = 0.0
    rss_mb: list[float] = field(default_factory=list)
    server_cpu_s: float = float("nan")

    def summary(self) -> str:
        latencies = sorted(self.latencies_s)
        p50 = statistics.median(latencies) if latencies else float("nan")
        p99 = latencies[int(0.99 * (len(latencies) - 1))] if latencies else float("nan")
        rss = self.rss_mb or [float("nan")]
        return (
            f"requests {self.requests}, answered {self.answered}, failures {len(self.failures)}, "
            f"duplicate ids {self.duplicate_ids}\n"
            f"throughput {self.answered / self.wall_s:.1f} requests/s, "
            f"{self.generated_tokens / self.wall_s:.1f} generated tokens/s "
            f"over {self.wall_s:.1f} s\n"
            f"latency p50 {p50:.2f} s, p99 {p99:.2f} s, max {max(latencies, default=0):.2f} s\n"
            f"server process CPU {self.server_cpu_s:.1f} s, "
            f"{1000 * self.server_cpu_s / max(self.answered, 1):.1f} ms per answered request\n"
            f"server process RSS: start {rss[0]:.0f} MB, peak {max(rss):.0f} MB, "
            f"end {rss[-1]:.0f} MB"
        )


async def run_load(
    base_url: str, tokenizer, *, clients: int, duration_s: float, max_tokens: int
) -> LoadReport:
    """`clients` concurrent loops against `base_url` until `duration_s` has passed (each client
    finishes the request it is in; at least one request each)."""
    report, seen_ids = LoadReport(), set()
    deadline = time.monotonic() + duration_s

    async def client(number: int, http: httpx.AsyncClient) -> None:
        index = 0
        while index == 0 or time.monotonic() < deadline:
            nonce = f"client-{number}-request-{index}"
            index += 1
            report.requests += 1
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Repeat {nonce}."}],
                "max_tokens": max_tokens,
                "seed": number * 100_000 + index,
            }
            started = time.monotonic()
            try:
                response = await http.post("/chat/completions", json=body)
            except httpx.HTTPError as error:
                report.failures.append(f"{nonce}: {type(error).__name__}: {error}")
                continue
            report.latencies_s.append(time.monotonic() - started)
            problem = _check(response, nonce, tokenizer)
            if problem:
                report.failures.append(f"{nonce}: {problem}")
                continue
            answer = response.json()
            report.duplicate_ids += answer["id"] in seen_ids
            seen_ids.add(answer["id"])
            report.answered += 1
            report.generated_tokens += answer["usage"]["completion_tokens"]

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    started = time.monotonic()
    async with httpx.AsyncClient(
        base_url=base_url,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=httpx.Timeout(duration_s + 300),
        limits=limits,
    ) as http:
        await asyncio.gather(*(client(number, http) for number in range(clients)))
    report.wall_s = time.monotonic() - started
    return report


def run_clients(
    base_url: str, cache_dir: Path, *, clients: int, duration_s: float, max_tokens: int
) -> LoadReport:
    """`run_load` in this process, with the tokenizer that checks the answers loaded here: the
    body of the client process."""
    tokenizer = load_tokenizer(ensure_smollm2_checkpoint(cache_dir))
    return asyncio.run(
        run_load(base_url, tokenizer, clients=clients, duration_s=duration_s, max_tokens=max_tokens)
    )


@contextmanager
def sampled_rss() -> Iterator[list[float]]:
    """This process's resident memory in MB, every 0.5 s while the block runs."""
    samples: list[float] = []
    sampling = threading.Event()

    def sample_memory() -> None:
        process = psutil.Process()
        while not sampling.wait(0.5):
            samples.append(process.memory_info().rss / 2**20)

    sampler = threading.Thread(target=sample_memory, daemon=True)
    sampler.start()
    try:
        yield samples
    finally:
        sampling.set()
        sampler.join()


def _cpu_s() -> float:
    """User and system CPU seconds of this process alone (not of its children)."""
    times = psutil.Process().cpu_times()
    return times.user + times.system


def _check(response: httpx.Response, nonce: str, tokenizer) -> str | None:
    if response.status_code != 200:
        return f"HTTP {response.status_code}: {response.text[:200]}"
    answer = response.json()
    message = answer["choices"][0]["message"]
    ids, logprobs = message["generation_token_ids"], message["generation_log_probs"]
    if not ids or len(ids) != len(logprobs):
        return f"token bundle of {len(ids)} ids and {len(logprobs)} log-probabilities"
    if nonce not in tokenizer.decode(message["prompt_token_ids"]):
        return "the answer's prompt is another request's"
    if answer["usage"]["completion_tokens"] != len(ids):
        return "usage.completion_tokens does not count the generated ids"
    return None


def serve_policy(
    model_name: str,
    threads: int,
    cache_dir: Path,
    *,
    loop: str,
    http: str,
    max_batch_size: int = GENERATION.max_batch_size,
):
    """The policy server on loopback with the torch engine, on uvicorn's `loop` and `http`."""
    torch.set_num_threads(threads)
    checkpoint = ensure_smollm2_checkpoint(cache_dir)
    tokenizer = load_tokenizer(checkpoint)
    if model_name == "tiny":
        model = build_tiny_llama(
            tokenizer, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=0
        )
    else:
        model = load_pretrained(checkpoint, dtype=torch.float32)
    engine = TorchGenerationEngine.from_config(
        model,
        GENERATION.model_copy(update={"max_batch_size": max_batch_size}),
        seed=0,
        compute_dtype="auto",
        eos_token_ids=[eos_token_id(tokenizer)],
    )
    # SmolLM2's format as conf/policy/smollm2_135m.yaml configures it.
    chat_format = ChatFormat(
        tokenizer, parser=GenerationParser("hermes"), chat_template="smollm2_tools"
    )
    app = create_policy_server_app(
        engine,
        chat_format,
        model_name=MODEL,
        api_key=SecretStr(KEY),
        honor_prompt_token_ids=True,
        default_max_tokens=16,
        max_context_tokens=2048,
        request_timeout_s=600,
        request_bytes_per_context_token=GENERATION.server.request_bytes_per_context_token,
        render_timeout_s=GENERATION.server.render_timeout_s,
    )
    return serve_in_thread(app, loop=loop, http=http, max_body_bytes=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--clients", type=int, default=256)
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-batch-size", type=int, default=GENERATION.max_batch_size)
    parser.add_argument("--cache-dir", type=Path, default=Path(MODEL_CACHE_DIR).expanduser())
    parser.add_argument(
        "--loop", choices=["auto", "asyncio", "uvloop"], default=SERVER_DEFAULTS["loop"].default
    )
    parser.add_argument(
        "--http", choices=["auto", "h11", "httptools"], default=SERVER_DEFAULTS["http"].default
    )
    args = parser.parse_args()
    server = serve_policy(
        args.model,
        args.threads,
        args.cache_dir,
        loop=args.loop,
        http=args.http,
        max_batch_size=args.max_batch_size,
    )
    # A fresh interpreter for the clients: forking would copy the server's threads' locks.
    spawn = multiprocessing.get_context("spawn")
    load = {"clients": args.clients, "duration_s": args.duration_s, "max_tokens": args.max_tokens}
    cpu_s_at_start = _cpu_s()
    try:
        with sampled_rss() as server_rss_mb, spawn.Pool(1) as pool:
            report = pool.apply(run_clients, (f"{server.url}/v1", args.cache_dir), load)
    finally:
        server.close(timeout_s=120.0)  # a batch still decoding for a client that gave up
    report.rss_mb = server_rss_mb
    report.server_cpu_s = _cpu_s() - cpu_s_at_start
    print(
        f"{args.model}, {args.clients} clients, {args.duration_s:g} s, max_tokens "
        f"{args.max_tokens}, {args.threads} torch threads, loop {args.loop}, http {args.http}, "
        f"batches of up to {args.max_batch_size}"
    )
    print(report.summary())
    for failure in report.failures[:5]:
        print("failure:", failure)


if __name__ == "__main__":
    main()

"""How long the policy server takes to refuse a 30 MB chat request, with and without a length.

The issue that asked for the body bound (42, item 5) measured 44.7 s with a `Content-Length` and
41.5 s sent chunked, both answered 400 by the context check after the body was read, parsed and
tokenised. This script posts the same kind of body (one user message of 30 MB of text, as a
client would that re-sends a long tool output) with httpx, as Gym's agents post, to the policy
server as `GenerationServer` serves it (SmolLM2's chat format, a tiny torch engine: the engine is
never reached), and reports the time to the answer and its status:

* `length`: the body sent with its `Content-Length`; httpx writes all of it before reading the
  answer, so the time includes sending 30 MB over loopback (the server has answered before
  reading it, and discards the rest);
* `chunked`: sent in 1 MB chunks without a length; the server reads up to its bound.

    python benchmarks/bench_body_refusal.py                          # context 2048 (SmolLM2)
    python benchmarks/bench_body_refusal.py --context 65536          # the flagship's context
    PYTHONPATH=<older checkout> python benchmarks/bench_body_refusal.py   # the "before" figures

At a context whose bound (context x `generation.server.request_bytes_per_context_token`) is above
30 MB, the body is read and rendered, and the render deadline (`render_timeout_s`) answers it.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import time
from collections.abc import Iterator

import httpx
from pydantic import SecretStr

from gymrl.config.schema.generation import TorchGenerationConfig
from gymrl.config.schema.policy import PolicyConfig
from gymrl.generation.server.app import create_policy_server_app
from gymrl.generation.server.chat_template import ChatFormat
from gymrl.generation.server.parsers import GenerationParser
from gymrl.generation.torch.engine import TorchGenerationEngine
from gymrl.model.loading import build_tiny_llama, ensure_smollm2_checkpoint, load_tokenizer
from nemo_gym_ext.http_server import serve_in_thread

KEY = "bench"
MODEL = "policy"
BODY_BYTES = 30_000_000
CHUNK_BYTES = 1_000_000
GENERATION = TorchGenerationConfig()  # the schema's defaults, as a run's server has them
MODEL_CACHE_DIR = PolicyConfig.model_fields["model_cache_dir"].default


def serve(context: int):
    """The policy server on loopback, configured as GenerationServer configures it (on a
    checkout from before issue 42: its flat 64 MiB body limit)."""
    tokenizer = load_tokenizer(ensure_smollm2_checkpoint(MODEL_CACHE_DIR))
    model = build_tiny_llama(
        tokenizer, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, seed=0
    )
    engine = TorchGenerationEngine.from_config(model, GENERATION, seed=0, compute_dtype="float32")
    chat_format = ChatFormat(
        tokenizer, parser=GenerationParser("hermes"), chat_template="smollm2_tools"
    )
    settings = {
        "model_name": MODEL,
        "api_key": SecretStr(KEY),
        "honor_prompt_token_ids": True,
        "default_max_tokens": 16,
        "max_context_tokens": context,
        "request_timeout_s": GENERATION.server.request_timeout_s,
    }
    bounded = "render_timeout_s" in inspect.signature(create_policy_server_app).parameters
    if bounded:
        settings["request_bytes_per_context_token"] = (
            GENERATION.server.request_bytes_per_context_token
        )
        settings["render_timeout_s"] = GENERATION.server.render_timeout_s
    app = create_policy_server_app(engine, chat_format, **settings)
    if bounded:  # the app bounds its bodies itself, unread
        return serve_in_thread(app, max_body_bytes=None)
    return serve_in_thread(app)  # the code before: RequestLimits' 64 MiB, read whole


def body() -> bytes:
    text = "x " * (BODY_BYTES // 2)
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}]}).encode()


def chunks(raw: bytes) -> Iterator[bytes]:
    for start in range(0, len(raw), CHUNK_BYTES):
        yield raw[start : start + CHUNK_BYTES]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=2048, help="the server's context, tokens")
    args = parser.parse_args()
    raw = body()
    print(
        f"# {platform.node()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
        f"context {args.context} tokens; body {len(raw)} bytes"
    )
    with serve(args.context) as server, httpx.Client(timeout=600) as client:
        url = f"{server.url}/v1/chat/completions"
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        for how, content in (("length", raw), ("chunked", chunks(raw))):
            started = time.perf_counter()
            answer = client.post(url, content=content, headers=headers)
            took = time.perf_counter() - started
            message = answer.json().get("error", {}).get("message", "")[:110]
            print(f"{how:8s} {took:7.2f} s  {answer.status_code}  {message}")


if __name__ == "__main__":
    main()

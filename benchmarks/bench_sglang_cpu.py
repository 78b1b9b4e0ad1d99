"""The real SGLang 0.5.23 server on this CPU against the torch engine, side by side.

For each thread count (1 and 2): one real server (SmolLM2-135M-Instruct, float32, started by the
project's launcher with the CPU `generation.launch` of `tests/support/real_sglang.py`,
from `make sglang-venv`'s venv), its start-up time (process start to `/health_generate` 200),
then the same batch of greedy requests through `SGLangEngine` and through the torch engine
(`torch.set_num_threads` to the same count), in turn, `--repeats` times; then `--refits` refits of
the server through `WeightSender` over gloo in 64 MiB flattened buckets (the first forms the
group). Prints one line per figure.

    SGLANG_VENV=/path/to/venv python benchmarks/bench_sglang_cpu.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test helper's root

from gymrl.config.schema.generation import TorchGenerationConfig
from gymrl.generation.sglang.engine import SGLangEngine
from gymrl.generation.sglang.weight_sync import WeightSender
from gymrl.generation.torch.engine import TorchGenerationEngine
from gymrl.generation.types import GenerationRequest, SamplingParams
from gymrl.model.loading import ensure_smollm2_checkpoint, load_pretrained, load_tokenizer
from gymrl.model.tokens import model_end_token_ids
from tests.support.real_sglang import cpu_generation, start_cpu_server  # a test helper

QUESTIONS = ["Name three colours.", "Describe a cat.", "Why is the sky blue?", "Count to ten."]


def chat_requests(tokenizer, new_tokens: int) -> list[GenerationRequest]:
    requests = []
    for question in QUESTIONS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        requests.append(GenerationRequest(ids, SamplingParams(new_tokens, temperature=0.0)))
    return requests


def tokens_per_s(generate, requests) -> float:
    start = time.perf_counter()
    outputs = generate(requests)
    seconds = time.perf_counter() - start
    return sum(len(out.token_ids) for out in outputs) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--refits", type=int, default=3)
    args = parser.parse_args()
    folder = ensure_smollm2_checkpoint("~/.cache/gym-grpo-recipes/models")
    tokenizer = load_tokenizer(folder)
    requests = chat_requests(tokenizer, args.new_tokens)
    weights = load_pretrained(folder, torch.float32).state_dict()
    print(f"batch: {len(requests)} greedy requests x {args.new_tokens} new tokens")
    for threads in args.threads:
        torch.set_num_threads(threads)
        with tempfile.TemporaryDirectory() as logs:
            start = time.perf_counter()
            server = start_cpu_server(
                folder, Path(logs) / "server.log", context_length=2048, cpu_threads=threads
            )
            try:
                print(f"threads={threads} start-up to healthy: {time.perf_counter() - start:.1f} s")
                _compare(server.base_url, folder, requests, threads, args.repeats)
                _refits(server.base_url, weights, threads, args.refits)
            finally:
                server.stop()


def _compare(url: str, folder: Path, requests, threads: int, repeats: int) -> None:
    model = load_pretrained(folder, torch.float32)
    local = TorchGenerationEngine.from_config(
        model,
        TorchGenerationConfig(
            max_batch_size=len(requests), prefix_cache_tokens=0, decode_path="transformers"
        ),
        seed=0,
        compute_dtype="float32",
        eos_token_ids=model_end_token_ids(folder),  # where the server stops too: same tokens
    )
    served = SGLangEngine([url], request_timeout_s=600.0, refit_timeout_s=600.0)
    try:
        served.generate(requests[:1])  # the server's first request pays for its lazy set-up
        real, torch_engine = [], []
        for _ in range(repeats):
            real.append(tokens_per_s(served.generate, requests))
            torch_engine.append(tokens_per_s(local.generate, requests))
        print(
            f"threads={threads} tokens/s real SGLang: {', '.join(f'{v:.1f}' for v in real)}; "
            f"torch engine: {', '.join(f'{v:.1f}' for v in torch_engine)}"
        )
    finally:
        served.close()
        local.close()


def _refits(url: str, weights, threads: int, refits: int) -> None:
    refit = cpu_generation().refit
    sender = WeightSender(
        [url],
        [1],
        master_address="127.0.0.1",
        backend="gloo",
        bucket_bytes=refit.bucket_bytes,
        timeout_s=refit.timeout_s,
    )
    engine = SGLangEngine([url], request_timeout_s=600.0, refit_timeout_s=600.0)
    seconds = []
    try:
        for version in range(1, refits + 1):
            start = time.perf_counter()
            engine.begin_refit(version)
            sender.send(weights.items(), version)
            engine.end_refit(version)
            seconds.append(time.perf_counter() - start)
    finally:
        sender.close()
        engine.close()
    later = statistics.median(seconds[1:]) if len(seconds) > 1 else float("nan")
    print(
        f"threads={threads} refit over gloo ({sender.bytes_sent / refits / 2**20:.0f} MiB, "
        f"{sender.broadcasts // refits} buckets): first {seconds[0]:.2f} s (forms the group), "
        f"then median {later:.2f} s of {', '.join(f'{s:.2f}' for s in seconds[1:])}"
    )


if __name__ == "__main__":
    main()

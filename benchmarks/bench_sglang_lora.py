"""A LoRA run's adapter refits into the real SGLang 0.5.23 server on this CPU, against full
refits, and generation with the adapter against the base.

One real server (SmolLM2-135M-Instruct, float32, `generation=sglang_cpu` of
`tests/support/real_sglang.py`, launched with the default `trainer.lora`'s adapter flags: rank 16,
every Linear of the 30 layers, `--lora-backend torch_native`, two versions kept), then:

* `--refits` adapter refits, `SGLangEngine.update_adapter` with a fresh adapter each (B drawn at
  random, as training leaves it): the load from tensors, its checksums, the listing check, and
  from the third on the unload of the version past the window;
* the same batch of greedy chat requests without an adapter (the base) and naming the loaded
  adapter, alternately, `--repeats` times (tokens/s counts generated tokens);
* `--refits` full refits of every weight through `WeightSender` over gloo in 64 MiB buckets,
  generation paused and resumed around each (the first forms the group): what a full-training
  run's refit into this server is (`+experiment=sglang_cpu_smoke`);
* then a server started without LoRA, the same batch `--repeats` times: what enabling LoRA
  costs the base's requests.

Prints one line per figure and the load average before and after (the machine is shared).

    PYTHONPATH=. python benchmarks/bench_sglang_lora.py [--refits 4 --repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import orjson
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test helper's root

from benchmarks.bench_sglang_cpu import chat_requests, tokens_per_s  # the same prompts and timing
from gymrl.config.schema.grpo import GRPOConfig
from gymrl.config.schema.trainer import LoraConfig
from gymrl.generation.sglang.adapters import AdapterServing, adapter_name, load_request
from gymrl.generation.sglang.engine import SGLangEngine
from gymrl.generation.sglang.weight_sync import WeightSender
from gymrl.model.loading import ensure_smollm2_checkpoint, load_pretrained, load_tokenizer
from gymrl.model.tokens import model_end_token_ids
from gymrl.run.adapter import AdapterWeights, attach_lora
from tests.support.real_sglang import cpu_generation, start_cpu_server  # a test helper


def _adapters(folder: Path, lora: LoraConfig, count: int) -> list[AdapterWeights]:
    model = attach_lora(load_pretrained(folder, torch.float32), lora)
    adapters = []
    for seed in range(count):
        torch.manual_seed(seed)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0.0, 0.01)
        adapters.append(AdapterWeights.of(model))
    return adapters


def _figures(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f} ({', '.join(f'{v:.2f}' for v in values)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--refits", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}")
    folder = ensure_smollm2_checkpoint("~/.cache/gym-grpo-recipes/models")
    lora = LoraConfig(enabled=True)
    grpo = GRPOConfig(num_steps=1, num_prompts_per_step=1, num_generations_per_prompt=2)
    serving = AdapterServing.of(lora, grpo, cpu_generation().launch)
    assert serving is not None
    adapters = _adapters(folder, lora, args.refits)
    requests = chat_requests(load_tokenizer(folder), args.new_tokens)
    with tempfile.TemporaryDirectory() as logs:
        server = start_cpu_server(
            folder, Path(logs) / "server.log", context_length=2048, adapters=serving
        )
        try:
            _adapter_part(server.base_url, folder, serving, adapters, requests, args.repeats)
            _full_refits(server.base_url, folder, args.refits)
        finally:
            server.stop()
        plain = start_cpu_server(folder, Path(logs) / "plain.log", context_length=2048)
        try:
            engine = SGLangEngine(
                [plain.base_url],
                request_timeout_s=600.0,
                refit_timeout_s=600.0,
                end_token_ids=model_end_token_ids(folder),
            )
            with engine:
                engine.generate(requests[:1])
                rates = [tokens_per_s(engine.generate, requests) for _ in range(args.repeats)]
            print(f"tokens/s on a server without --enable-lora: {_figures(rates)}")
        finally:
            plain.stop()
    print(f"load average at end: {os.getloadavg()}")


def _adapter_part(url, folder, serving, adapters, requests, repeats: int) -> None:
    start = time.perf_counter()
    body = len(orjson.dumps(load_request(adapters[0], 1, 1)))
    encode_s = time.perf_counter() - start
    print(
        f"adapter: {adapters[0].num_bytes / 2**20:.1f} MiB of tensors "
        f"({len(adapters[0].tensors)}), a load request of {body / 2**20:.1f} MiB (base64 JSON), "
        f"made (pickle, base64, checksums, JSON) in {encode_s:.2f} s"
    )
    engine = SGLangEngine(
        [url],
        request_timeout_s=600.0,
        refit_timeout_s=600.0,
        end_token_ids=model_end_token_ids(folder),
        adapters=serving,
    )
    try:
        engine.generate(requests[:1])  # the server's first request pays for its lazy set-up
        seconds = []
        for version, adapter in enumerate(adapters, start=1):
            start = time.perf_counter()
            engine.update_adapter(adapter, version)
            seconds.append(time.perf_counter() - start)
        print(f"adapter refit s: {_figures(seconds)}")
        base, adapted = [], []
        plain = SGLangEngine(
            [url],
            request_timeout_s=600.0,
            refit_timeout_s=600.0,
            end_token_ids=model_end_token_ids(folder),
        )
        try:
            for _ in range(repeats):
                base.append(tokens_per_s(plain.generate, requests))
                adapted.append(tokens_per_s(engine.generate, requests))
        finally:
            plain.close()
        print(f"tokens/s base (no lora_path): {_figures(base)}")
        print(f"tokens/s with {adapter_name(len(adapters))}: {_figures(adapted)}")
    finally:
        engine.close()


def _full_refits(url: str, folder: Path, refits: int) -> None:
    weights = load_pretrained(folder, torch.float32).state_dict()
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
    print(
        f"full refit over gloo ({sender.bytes_sent / refits / 2**20:.0f} MiB): first "
        f"{seconds[0]:.2f} s (forms the group), then {_figures(seconds[1:])}"
    )


if __name__ == "__main__":
    main()

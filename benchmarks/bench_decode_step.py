"""One decode step of SmolLM2-135M-Instruct's transformer body under bfloat16 autocast: with the
weights in float32 (autocast rounds every Linear weight again on every call) against the weights
rounded once (`round_body_matmul_weights`, what `TorchGenerationEngine` does).

A decode step is one new token per row; the body's matmuls are most of it, so the step is timed
without a KV cache (attention over a cache adds the same to both). Both contenders see the same
ids, alternate, and each figure is the median of `--repeats` timings of `--calls` calls.

    python benchmarks/bench_decode_step.py --threads 2
    python benchmarks/bench_decode_step.py --threads 1 --batch-sizes 1 8 16
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from transformers import PreTrainedModel

from gymrl.config.compose import compose_raw
from gymrl.model.policy import build_policy
from gymrl.model.precision import body_autocast, round_body_matmul_weights
from gymrl.preflight.validate import validate_config

CPU = torch.device("cpu")


def step_ms(model: PreTrainedModel, ids: torch.Tensor, calls: int) -> float:
    with torch.inference_mode(), body_autocast(CPU, torch.bfloat16):
        started = time.perf_counter()
        for _ in range(calls):
            model.base_model(input_ids=ids)
        return (time.perf_counter() - started) / calls * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    policy = validate_config(compose_raw([])).policy  # the embedded default's SmolLM2
    float32, _ = build_policy(policy, seed=0)
    float32.eval()
    rounded = copy.deepcopy(float32)
    round_body_matmul_weights(rounded, torch.bfloat16)
    contenders = {"float32 weights": float32, "rounded once": rounded}
    print(f"torch threads {torch.get_num_threads()}; ms per decode step, median of {args.repeats}")
    print("| batch | float32 weights, autocast | rounded once | ratio |")
    print("|---:|---:|---:|---:|")
    generator = torch.Generator().manual_seed(0)
    for batch_size in args.batch_sizes:
        ids = torch.randint(0, 49152, (batch_size, 1), generator=generator)
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for model in contenders.values():
            step_ms(model, ids, calls=2)  # warm-up
        for _ in range(args.repeats):
            for name, model in contenders.items():
                times[name].append(step_ms(model, ids, args.calls))
        before, after = (statistics.median(times[name]) for name in contenders)
        print(f"| {batch_size} | {before:.1f} | {after:.1f} | {before / after:.2f}x |")


if __name__ == "__main__":
    main()

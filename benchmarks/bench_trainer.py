"""Trainer tokens per second: `TorchPolicyTrainer.train_step` on SmolLM2-135M-Instruct, per
`policy.compute_dtype`.

One step is the shape of a `+experiment=learn` step: 16 episodes of 300-600 tokens with the last
quarter generated (random ids; the cost does not depend on them), micro-batches of 4. Both choices
train the same batch from the same weights, interleaved after a warm-up step; tokens/s counts
every token of the step (prompt tokens cost a forward and backward pass too).

    python benchmarks/bench_trainer.py --threads 1            # one core, as async training has
    python benchmarks/bench_trainer.py --threads 2 --repeats 5
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from gymrl.algo.trajectory import Trajectory
from gymrl.config.compose import compose_raw
from gymrl.config.schema import LossConfig, TorchOptimizerConfig, TorchTrainerConfig
from gymrl.model.policy import build_policy
from gymrl.model.precision import native_bfloat16
from gymrl.model.tokens import pad_token_id
from gymrl.preflight.validate import validate_config
from gymrl.trainer.torch_trainer import TorchPolicyTrainer

CHOICES = ("float32", "bfloat16")


def episodes(count: int, generator: torch.Generator) -> list[Trajectory]:
    batch = []
    for index in range(count):
        length = int(torch.randint(300, 601, (1,), generator=generator))
        generated = length // 4
        ids = torch.randint(0, 49152, (length,), generator=generator).tolist()
        mask = [0] * (length - generated) + [1] * generated
        logprobs = [-2.0 * m for m in mask]
        batch.append(Trajectory(ids, mask, logprobs, float(index % 2), "bench", "g", 0))
    return batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    policy = validate_config(compose_raw([])).policy  # the embedded default's SmolLM2
    model, tokenizer = build_policy(policy, seed=0)
    trainers = {
        choice: TorchPolicyTrainer(
            copy.deepcopy(model),
            TorchTrainerConfig(optimizer=TorchOptimizerConfig(lr=1e-6)),
            LossConfig(),
            temperature=1.0,
            pad_token_id=pad_token_id(tokenizer),
            keep_last_checkpoints=1,
            compute_dtype=choice,
        )
        for choice in CHOICES
    }
    batch = episodes(args.episodes, torch.Generator().manual_seed(0))
    advantages = torch.tensor([t.reward - 0.5 for t in batch])
    tokens = sum(len(t.token_ids) for t in batch)
    print(
        f"torch threads {torch.get_num_threads()}, {args.episodes} episodes, {tokens} tokens/step, "
        f"native bfloat16 on this CPU: {native_bfloat16(torch.device('cpu'))}"
    )
    seconds: dict[str, list[float]] = {choice: [] for choice in CHOICES}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for choice, trainer in trainers.items():
            started = time.perf_counter()
            trainer.train_step(batch, advantages)
            if repeat:
                seconds[choice].append(time.perf_counter() - started)
    for choice, times in seconds.items():
        median = statistics.median(times)
        print(f"  {choice:>8}: {median:6.2f} s/step  {tokens / median:7.0f} tokens/s")


if __name__ == "__main__":
    main()

"""Trainer tokens per second: `TorchPolicyTrainer.train_step` on SmolLM2-135M-Instruct, per
`policy.compute_dtype` and `trainer.prefix_packing` (and its `max_packed_tokens`).

Two batch shapes (random ids; the cost does not depend on them):

* `random`: 16 episodes of 300-600 tokens with the last quarter generated and no shared prefix
  (prefix packing has nothing to share: what is left is packing without padding).
* `shared-prefix`: the embedded task's (`+experiment=learn` on the calculator agent): 4 groups x
  4 episodes, a 330-token system prompt every episode starts with, a 34-token question per group,
  60-120 generated tokens per episode (90 on average).

Every combination asked for (dtype x packing off / on at each budget) trains the same batch from
the same weights, interleaved after a warm-up step. Tokens/s counts every token of every episode,
packed or not, so both sides divide the same count. The peak resident memory printed is the
whole process's: run one combination at a time to compare memories.

    python benchmarks/bench_trainer.py --threads 1            # dtypes, one core (async training)
    python benchmarks/bench_trainer.py --threads 2 --repeats 5
    python benchmarks/bench_trainer.py --threads 2 --batch shared-prefix --dtypes auto \\
        --packing off on --max-packed-tokens 1024 2048        # the prefix packing speed-up
"""

from __future__ import annotations

import argparse
import copy
import resource
import statistics
import time

import torch

from gymrl.algo.trajectory import Trajectory
from gymrl.config.compose import compose_raw
from gymrl.config.schema.loss import LossConfig
from gymrl.config.schema.trainer import TorchOptimizerConfig, TorchTrainerConfig
from gymrl.model.policy import build_policy
from gymrl.model.precision import native_bfloat16
from gymrl.model.tokens import pad_token_id
from gymrl.preflight.validate import validate_config
from gymrl.trainer.prefix_packing import pack_prefix_tree
from gymrl.trainer.torch_trainer import TorchPolicyTrainer

VOCAB = 49152
PACKING = {"off": False, "on": True}


def _ids(count: int, generator: torch.Generator) -> list[int]:
    return torch.randint(0, VOCAB, (count,), generator=generator).tolist()


def _trajectory(ids: list[int], generated: int, reward: float) -> Trajectory:
    """An episode of `ids` whose last `generated` tokens were sampled."""
    mask = [0] * (len(ids) - generated) + [1] * generated
    logprobs = [-2.0 * m for m in mask]
    return Trajectory(ids, mask, logprobs, reward, "bench", "g", 0)


def random_episodes(count: int, generator: torch.Generator) -> list[Trajectory]:
    batch = []
    for index in range(count):
        length = int(torch.randint(300, 601, (1,), generator=generator))
        generated = length // 4
        batch.append(_trajectory(_ids(length, generator), generated, float(index % 2)))
    return batch


def shared_prefix_episodes(
    groups: int, group_size: int, generator: torch.Generator
) -> list[Trajectory]:
    system = _ids(330, generator)
    batch = []
    for _ in range(groups):
        prompt = system + _ids(34, generator)
        for index in range(group_size):
            generated = int(torch.randint(60, 121, (1,), generator=generator))
            ids = prompt + _ids(generated, generator)
            batch.append(_trajectory(ids, generated, float(index % 2)))
    return batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", choices=("random", "shared-prefix"), default="random")
    parser.add_argument("--episodes", type=int, default=16, help="random batch: episodes")
    parser.add_argument("--groups", type=int, default=4, help="shared-prefix batch: groups")
    parser.add_argument("--group-size", type=int, default=4, help="shared-prefix: per group")
    parser.add_argument(
        "--dtypes",
        nargs="+",
        choices=("float32", "bfloat16", "auto"),
        default=["float32", "bfloat16"],
    )
    parser.add_argument("--packing", nargs="+", choices=tuple(PACKING), default=["on"])
    defaults = TorchTrainerConfig()
    parser.add_argument(
        "--micro-batch-size", type=int, default=defaults.micro_batch_size, help="packing off"
    )
    parser.add_argument(
        "--max-packed-tokens",
        type=int,
        nargs="+",
        default=[defaults.max_packed_tokens],
        help="packing on: one run per budget",
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    policy = validate_config(compose_raw([])).policy  # the embedded default's SmolLM2
    model, tokenizer = build_policy(policy, seed=0)
    # (dtype, packing budget): packing on runs once per budget asked for, None is packing off.
    settings = [
        (dtype, budget)
        for dtype in args.dtypes
        for packing in args.packing
        for budget in (args.max_packed_tokens if PACKING[packing] else [None])
    ]
    trainers = {
        (dtype, budget): TorchPolicyTrainer(
            copy.deepcopy(model),
            TorchTrainerConfig(
                micro_batch_size=args.micro_batch_size,
                prefix_packing=budget is not None,
                max_packed_tokens=budget or defaults.max_packed_tokens,
                optimizer=TorchOptimizerConfig(lr=1e-6),
            ),
            LossConfig(),
            temperature=1.0,
            pad_token_id=pad_token_id(tokenizer),
            keep_last_checkpoints=1,
            compute_dtype=dtype,
        )
        for dtype, budget in settings
    }
    generator = torch.Generator().manual_seed(0)
    if args.batch == "random":
        batch = random_episodes(args.episodes, generator)
    else:
        batch = shared_prefix_episodes(args.groups, args.group_size, generator)
    advantages = torch.tensor([t.reward - 0.5 for t in batch])
    tokens = sum(len(t.token_ids) for t in batch)
    nodes = pack_prefix_tree([t.token_ids for t in batch]).num_nodes
    print(
        f"torch threads {torch.get_num_threads()}, {len(batch)} episodes, {tokens} tokens/step "
        f"({nodes} as one prefix tree), native bfloat16 on this CPU: "
        f"{native_bfloat16(torch.device('cpu'))}"
    )
    seconds: dict[tuple[str, int | None], list[float]] = {key: [] for key in trainers}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for key, trainer in trainers.items():
            started = time.perf_counter()
            trainer.train_step(batch, advantages)
            if repeat:
                seconds[key].append(time.perf_counter() - started)
    for (dtype, budget), times in seconds.items():
        median = statistics.median(times)
        mode = f"packing on, max {budget} tokens" if budget else "packing off"
        print(
            f"  {dtype:>8}, {mode:>28}: {median:6.2f} s/step  "
            f"{tokens / median:7.0f} tokens/s  (steps: {', '.join(f'{t:.2f}' for t in times)})"
        )
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak resident memory of this process: {peak_gib:.2f} GiB")


if __name__ == "__main__":
    main()

"""Checkpoint integrity cost: hash throughput and the save, verify and load of a 135M checkpoint.

The checkpoint is the torch trainer's for SmolLM2-135M-Instruct as the embedded default loads it
(fp32 weights, about 0.5 GB) with AdamW state after one step (two fp32 moments, about 1 GB): what
`save_checkpoint` writes, `latest_verified_checkpoint` checks at resume and `load_checkpoint`
reads back. Hash throughput is measured on its largest file, read from the page cache, so it is
the hash's speed, not the disk's; the checkpoint timings are the median of `--repeats` rounds.

    python benchmarks/bench_checkpoint.py                      # under a temporary folder
    python benchmarks/bench_checkpoint.py --dir /scratch/ckpt  # on the filesystem runs use
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from gymrl.config.compose import compose_raw
from gymrl.model.policy import build_policy
from gymrl.preflight.validate import validate_config
from gymrl.run.checkpoint import (
    TrainerState,
    capture_rng_state,
    digest_file,
    latest_verified_checkpoint,
    load_checkpoint,
    save_checkpoint,
)


def _median_seconds(action, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model, _ = build_policy(validate_config(compose_raw([])).policy, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()  # creates both moments, as a trained run's optimizer holds them
    state = TrainerState(1, 1, {"position": 0}, [capture_rng_state()])

    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        root = Path(directory)
        saved = save_checkpoint(root, model, optimizer, state, keep_last=1)
        files = sorted(p for p in saved.iterdir() if p.is_file())
        total = sum(p.stat().st_size for p in files)
        print(
            f"checkpoint: {len(files)} files, {total / 1e9:.2f} GB, torch threads "
            f"{torch.get_num_threads()}"
        )
        largest = max(files, key=lambda p: p.stat().st_size)
        size = largest.stat().st_size
        for algorithm in ("sha256", "xxh3_128"):  # the old manifests' hash and today's
            digest_file(largest, algorithm)  # into the page cache
            seconds = _median_seconds(lambda a=algorithm: digest_file(largest, a), args.repeats)
            print(f"hash {algorithm:9s} {largest.name}: {size / seconds / 1e9:.2f} GB/s")
        timings = {
            "save": lambda: save_checkpoint(root, model, optimizer, state, keep_last=1),
            "verify": lambda: latest_verified_checkpoint(root),
            "load": lambda: load_checkpoint(saved, model, optimizer),
        }
        for name, action in timings.items():
            print(f"{name:6s} {_median_seconds(action, args.repeats):.2f} s")


if __name__ == "__main__":
    main()

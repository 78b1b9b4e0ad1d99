"""Seconds per refit of the torch engine through Ray's object store, as a training run does it.

    python benchmarks/bench_object_store_refit.py --refits 5
    python benchmarks/bench_object_store_refit.py --refits 5 policy.compute_dtype=float32
    python benchmarks/bench_object_store_refit.py --refits 5 trainer.lora.enabled=true

Starts the run's own roles on a local Ray (`start_generation_server`, `start_trainer`, the
placement a run gets) for the embedded default (SmolLM2-135M-Instruct; any recipe overrides),
then times `--refits` calls of `TrainerRole.refit`, the call a training step ends with: the
trainer exports its weights into the object store, the generation server fetches them and loads
them once the rows in flight end (none here). Prints the bytes one refit moves, in the engine's
dtypes, and the seconds of every refit after the first (the first also asks the engine for its
dtypes and warms the object store). With `trainer.lora.enabled=true` a refit moves the adapter
alone, which the engine merges into its base weights (`update_adapter`).
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench_roles import start_benchmark_generation

from gymrl.cluster.ray_calls import wait_for
from gymrl.cluster.session import ClusterSession
from gymrl.config.compose import compose_raw
from gymrl.model.policy import build_policy
from gymrl.preflight.validate import validate_config
from gymrl.roles.trainer import start_trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--refits", type=int, default=5, help="refits to time (after a first)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each role")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, e.g. policy.dtype=...")
    args = parser.parse_args()
    config = validate_config(compose_raw(args.overrides))
    if config.generation.backend != "torch":
        parser.error("the object-store refit is the torch engine's: run with generation=torch")
    with ClusterSession() as cluster:
        cluster.start(config)
        output_dir, generation = start_benchmark_generation(
            config, cluster, name="bench_object_store_refit", threads=args.threads
        )
        trainer = start_trainer(
            config,
            output_dir,
            torch_threads=args.threads,
            placement=cluster.placement,
            group=cluster.group,
            on_cleanup=cluster.on_cleanup,
        )
        dtypes = wait_for(generation.actor.weight_dtypes.remote(), timeout_s=60, what="dtypes")
        seconds = []
        for version in range(args.refits + 1):
            began = time.monotonic()
            trainer.refit(generation.actor, version)
            seconds.append(time.monotonic() - began)
        adapter = (
            wait_for(trainer._actor.export_adapter.remote(), timeout_s=60, what="the adapter")
            if config.trainer.lora.enabled
            else None
        )
    moved = _bytes_in(dtypes, config) if adapter is None else adapter.num_bytes
    what = "the adapter" if adapter is not None else "every weight"
    print(
        f"engine dtypes: {sorted({str(d) for d in dtypes.values()})}; one refit moves {what}, "
        f"{moved / 2**20:.1f} MiB"
    )
    print(f"first refit {seconds[0]:.2f} s (asks the engine's dtypes)")
    timed = seconds[1:]
    print(
        f"refit s: median {statistics.median(timed):.2f}, min {min(timed):.2f}, "
        f"max {max(timed):.2f} over {len(timed)}"
    )


def _bytes_in(dtypes, config) -> int:
    """Bytes of one export in the engine's dtypes: the model's state dict, sized per tensor."""
    model, _ = build_policy(config.policy, config.run.seed)
    return sum(
        tensor.numel() * dtypes[name].itemsize for name, tensor in model.state_dict().items()
    )


if __name__ == "__main__":
    main()

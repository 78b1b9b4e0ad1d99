"""What the benchmarks that drive the roles themselves share: the output folder and the
generation server on a started `ClusterSession`, as the recipes start it for the run's own
episodes (`bench_object_store_refit.py`, `bench_rollout_timeline.py`)."""

from __future__ import annotations

from pathlib import Path

from gymrl.cluster.session import ClusterSession
from gymrl.config.schema.recipe import RecipeConfig
from gymrl.generation.server.api_key import resolve_api_key
from gymrl.roles.generation_server import GenerationRole, start_generation_server


def start_benchmark_generation(
    config: RecipeConfig, cluster: ClusterSession, *, name: str, threads: int
) -> tuple[Path, GenerationRole]:
    """`outputs/<name>/` (made) and the generation server started there with `threads` torch
    threads, closed by `cluster`."""
    output_dir = Path("outputs", name).resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    generation = start_generation_server(
        config,
        output_dir=output_dir,
        torch_threads=threads,
        placement=cluster.placement,
        group=cluster.group,
        api_key=resolve_api_key(None),
        on_cleanup=cluster.on_cleanup,
        episode_deadline_s=config.env.rollout.run_timeout_s,
    )
    return output_dir, generation

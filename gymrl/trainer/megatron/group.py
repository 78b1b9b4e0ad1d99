"""The Megatron trainer as one Ray actor per trainer GPU, placed by `gymrl.cluster.placement`."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from gymrl.algo.trajectory import Trajectory
from gymrl.cluster.placement import RolePlacement, actor_options
from gymrl.cluster.ray_calls import wait_for, wait_for_all
from gymrl.config.schema.generation import RefitConfig
from gymrl.config.schema.recipe import RecipeConfig
from gymrl.generation.sglang.weight_sync import WEIGHT_SYNC_NCCL_ENV
from gymrl.run.adapter import AdapterWeights
from gymrl.trainer.grpo_step import reduce_loss_metrics
from gymrl.trainer.megatron.arguments import (
    data_parallel_size,
    megatron_config,
    unsupported_settings,
)
from gymrl.trainer.megatron.distributed import distributed_env
from gymrl.trainer.megatron.worker import NOTHING_TRAINED, MegatronPolicyTrainer
from gymrl.trainer.parity_gate import PASSED_METRIC, ParityCheck
from nemo_gym_ext.ports import free_port


def _node_address() -> tuple[str, int]:
    """Rank 0's node address and a free port there: the rendezvous of torch.distributed."""
    import ray

    return ray.util.get_node_ip_address(), free_port()


def merge_step_metrics(reports: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """One step's metrics from every rank's `train_step` (the reporting ranks' non-empty ones,
    one per data-parallel replica)."""
    reporting = [report for report in reports if report]
    if not reporting:
        raise RuntimeError("no trainer rank reported metrics (no last pipeline stage?)")
    if reporting[0] == NOTHING_TRAINED:
        return dict(NOTHING_TRAINED)
    merged = reduce_loss_metrics(reporting)
    merged["num_sequences"] = sum(report["num_sequences"] for report in reporting)
    merged["grad_norm"] = reporting[0]["grad_norm"]  # global norm: the same on every rank
    merged["lr"] = reporting[0]["lr"]
    if PASSED_METRIC in reporting[0]:  # every rank checked the same merged figures
        merged[PASSED_METRIC] = reporting[0][PASSED_METRIC]
    return merged


class MegatronTrainerGroup:
    """The Megatron trainer as one Ray actor per trainer GPU (see `gymrl.roles.trainer`).

    Needs a running Ray cluster with the GPUs. Every call goes to all ranks (Megatron's
    collectives need them all) and waits at most `call_timeout_s` (`grpo.batch_timeout_s`,
    which its errors name) through :func:`wait_for_all`, so the no-progress watchdog and a stop
    reach it and a rank that does not answer is named; metrics come from the reporting ranks
    (one per data-parallel replica), combined by :func:`reduce_loss_metrics`.
    """

    def __init__(
        self,
        config: RecipeConfig,
        *,
        placement_group: Any,
        ranks: RolePlacement,
        temperature: float,
        start_timeout_s: float,
        call_timeout_s: float,
    ) -> None:
        """`ranks` is the trainer's part of the run's placement (`gymrl.cluster.placement`): one
        bundle index of `placement_group` per rank."""
        import ray

        problems = unsupported_settings(config)
        if problems:
            raise ValueError("cannot train with Megatron: " + "; ".join(problems))
        world_size = len(ranks.bundle_of_actor)
        data_parallel_size(world_size, megatron_config(config))
        self._ray = ray
        self._timeout = call_timeout_s
        probe = actor_options(replace(ranks, gpus_per_actor=0.0), 0, placement_group)
        address = ray.remote(_node_address).options(**probe)
        master_addr, master_port = wait_for(
            address.remote(),
            timeout_s=start_timeout_s,
            what="placing the Megatron trainer's rank 0 (trainer.start_timeout_s)",
        )
        worker = ray.remote(MegatronPolicyTrainer)
        self._actors = [
            worker.options(
                **actor_options(
                    ranks,
                    rank,
                    placement_group,
                    # Rank 0 joins the SGLang servers' weight-sync communicator; every rank
                    # shares its NCCL settings (one communicator holds all trainer ranks).
                    env_vars=distributed_env(rank, world_size, master_addr, master_port)
                    | dict(WEIGHT_SYNC_NCCL_ENV),
                )
            ).remote(config, temperature=temperature)
            for rank in range(world_size)
        ]
        # Construction (rendezvous, model load) runs in every actor at once; wait for all.
        started = wait_for(
            [actor.ready.remote() for actor in self._actors],
            timeout_s=start_timeout_s,
            what=f"starting the Megatron trainer's {world_size} ranks (trainer.start_timeout_s)",
        )
        if started != list(range(world_size)):
            raise RuntimeError(
                f"trainer actors report ranks {started}, expected 0..{world_size - 1}"
            )

    def _all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        calls = [getattr(actor, method).remote(*args, **kwargs) for actor in self._actors]
        return wait_for_all(
            calls,
            timeout_s=self._timeout,
            what=f"the Megatron trainer's {method} (grpo.batch_timeout_s)",
            member="rank",
        )

    def train_step(
        self,
        trajectories: Sequence[Trajectory],
        advantages: torch.Tensor,
        parity: ParityCheck | None = None,
    ) -> dict[str, float]:
        """One optimizer step on every rank; `parity` is checked by every rank on the step's
        merged figures before the update (see the worker)."""
        shared_trajectories = self._ray.put(list(trajectories))
        shared_advantages = self._ray.put(advantages)
        reports = self._all("train_step", shared_trajectories, shared_advantages, parity)
        return merge_step_metrics(reports)

    def compute_logprobs(self, trajectories: Sequence[Trajectory]) -> list[list[float] | None]:
        """Per trajectory (None for masked ones)."""
        found: dict[int, list[float]] = {}
        for part in self._all("compute_logprobs", self._ray.put(list(trajectories))):
            found |= part
        return [found.get(index) for index in range(len(trajectories))]

    def export_weights(self) -> Mapping[str, torch.Tensor]:
        return self._all("export_weights")[0]

    def export_adapter(self) -> AdapterWeights:
        """The LoRA adapter in PEFT's format (every rank exports; rank 0's is returned)."""
        return self._all("export_adapter")[0]

    def send_weights(
        self, urls: list[str], tp_sizes: list[int], refit: RefitConfig, version: int
    ) -> int:
        """Rank 0 broadcasts the weights to the SGLang servers (see the worker); its byte count."""
        return self._all("send_weights", urls, tp_sizes, refit, version)[0]

    def export_hf_checkpoint(self, directory: str | os.PathLike[str]) -> str:
        return self._all("export_hf_checkpoint", str(directory))[0]

    def save_checkpoint(self, directory: Path, step: int, data_state: Mapping[str, Any]) -> Path:
        return Path(self._all("save_checkpoint", str(directory), step, dict(data_state))[0])

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        return self._all("load_checkpoint", str(path))[0]

    def shutdown(self) -> None:
        """End the ranks; the placement group belongs to whoever reserved it."""
        for actor in self._actors:
            # Ray types a created actor as `ActorHandle | type[cls]` (so its methods type-check);
            # kill takes the handle, which is what it is at run time.
            self._ray.kill(actor)  # pyright: ignore[reportArgumentType]

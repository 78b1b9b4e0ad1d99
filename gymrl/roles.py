"""Driver-side handles of the trainer role, one per backend, with the same five verbs.

The loop does not care whether the trainer is one torch actor or a group of Megatron ranks: it
trains a step, refits the generation server to a weight version, saves and loads checkpoints.
How weights reach the engines differs: the torch trainer hands its state dict to the torch engine
through Ray's object store. SGLang servers get them by broadcast from the trainer's rank 0
(`generation.refit.transport: nccl`, :func:`broadcast_refit`, `gymrl.generation.weight_sync`)
or, with `transport: disk`, as a Hugging Face checkpoint on shared disk (the torch trainer's goes
through the generation server), each version deleted once the next one is loaded everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from gymrl.actors import PolicyTrainerActor, close_actor
from gymrl.algo.trajectory import Trajectory
from gymrl.config.schema import MegatronTrainerConfig, RecipeConfig, SGLangGenerationConfig
from gymrl.generation.sglang_engine import remove_loaded_refits
from gymrl.placement import Placement, actor_options
from gymrl.ray_calls import wait_for


class TrainerRole(Protocol):
    def train_step(self, trajectories: list[Trajectory], advantages: torch.Tensor) -> dict: ...

    def refit(self, generation: Any, version: int) -> None: ...

    def save_checkpoint(self, directory: Path, step: int, data_state: dict) -> None: ...

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        """Restore and return at least `step` and `data_state`."""
        ...

    def close(self) -> None:
        """End every process and GPU reservation the role holds."""
        ...


class TorchTrainerRole:
    def __init__(
        self, config: RecipeConfig, *, torch_threads: int, placement: Placement, group: Any
    ):
        self._timeout_s = config.grpo.batch_timeout_s
        generation = config.generation
        self._refit = generation.refit if isinstance(generation, SGLangGenerationConfig) else None
        role = placement.trainer
        self._actor = PolicyTrainerActor.options(**actor_options(role, 0, group)).remote(
            config.policy,
            config.trainer,
            config.loss,
            seed=config.run.seed,
            temperature=config.generation.sampling.temperature,
            keep_last_checkpoints=config.checkpoint.keep_last,
            torch_threads=torch_threads,
            device=role.device,
        )
        try:
            wait_for(
                self._actor.weight_version.remote(),  # answers once the model is built
                timeout_s=config.trainer.start_timeout_s,
                what="starting the torch trainer (trainer.start_timeout_s)",
            )
        except BaseException:
            close_actor(self._actor)  # the recipe's cleanup never sees a role that did not start
            raise

    def train_step(self, trajectories: list[Trajectory], advantages: torch.Tensor) -> dict:
        return self._wait(self._actor.train_step.remote(trajectories, advantages), "a train step")

    def refit(self, generation: Any, version: int) -> None:
        if self._refit is not None and self._refit.transport == "nccl":
            refit = self._refit

            def send(urls: list[str], tp_sizes: list[int]) -> None:
                ref = self._actor.send_weights.remote(urls, tp_sizes, refit, version)
                self._wait(ref, "the weight broadcast")

            broadcast_refit(generation, version, send, self._wait)
            return
        weights = self._actor.export_weights.remote()  # stays in the object store
        self._wait(generation.update_weights.remote(weights, version), "the engine refit")

    def save_checkpoint(self, directory: Path, step: int, data_state: dict) -> None:
        self._wait(
            self._actor.save_checkpoint.remote(str(directory), step, data_state), "a checkpoint"
        )

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        return self._wait(self._actor.load_checkpoint.remote(str(path)), "loading a checkpoint")

    def close(self) -> None:
        close_actor(self._actor)  # nothing to flush: checkpoints are written when asked for

    def _wait(self, ref: Any, what: str) -> Any:
        return wait_for(ref, timeout_s=self._timeout_s, what=what)


class MegatronTrainerRole:
    def __init__(self, config: RecipeConfig, output_dir: Path, placement: Placement, group: Any):
        from gymrl.trainer.megatron.group import MegatronTrainerGroup  # needs CUDA + megatron

        self._refit_dir = output_dir / "refit"
        self._timeout_s = config.grpo.batch_timeout_s
        assert isinstance(config.generation, SGLangGenerationConfig)  # the validator's rule
        self._refit = config.generation.refit
        self._group = MegatronTrainerGroup(
            config,
            placement_group=group,
            ranks=placement.trainer,
            temperature=config.generation.sampling.temperature,
            start_timeout_s=config.trainer.start_timeout_s,
            call_timeout_s=config.grpo.batch_timeout_s,
        )

    def train_step(self, trajectories: list[Trajectory], advantages: torch.Tensor) -> dict:
        return self._group.train_step(trajectories, advantages)

    def refit(self, generation: Any, version: int) -> None:
        if self._refit.transport == "nccl":
            refit = self._refit
            broadcast_refit(
                generation,
                version,
                lambda urls, tp_sizes: self._group.send_weights(urls, tp_sizes, refit, version),
                self._wait,
            )
            return
        path = self._group.export_hf_checkpoint(self._refit_dir / f"v{version}")
        wait_for(
            generation.refit_from_disk.remote(str(path), version),
            timeout_s=self._timeout_s,
            what="the SGLang refit",
        )
        remove_loaded_refits(self._refit_dir, keep=path)  # every server has loaded `path`

    def _wait(self, ref: Any, what: str) -> Any:
        return wait_for(ref, timeout_s=self._timeout_s, what=what)

    def save_checkpoint(self, directory: Path, step: int, data_state: dict) -> None:
        self._group.save_checkpoint(directory, step, data_state)

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        return self._group.load_checkpoint(path)

    def close(self) -> None:
        self._group.shutdown()


def broadcast_refit(
    generation: Any,
    version: int,
    send: Callable[[list[str], list[int]], Any],
    wait: Callable[[Any, str], Any],
) -> None:
    """Refit SGLang by broadcast: the generation server pauses its engines, the trainer's rank 0
    `send`s the weights to the servers' URLs (`generation.refit.transport: nccl`), the engines
    continue under `version`. A failure leaves them paused and raises, as a disk refit does."""
    wait(generation.begin_refit.remote(), "pausing the SGLang servers")
    urls, tp_sizes = wait(generation.weight_sync_targets.remote(), "the SGLang server URLs")
    send(urls, tp_sizes)
    wait(generation.end_refit.remote(version), "resuming the SGLang servers")


def build_trainer_role(
    config: RecipeConfig, output_dir: Path, torch_threads: int, placement: Placement, group: Any
) -> TrainerRole:
    """The trainer of `config`, its actors placed as `placement` says, in the run's placement
    `group` (`gymrl.placement.reserve`)."""
    if isinstance(config.trainer, MegatronTrainerConfig):
        return MegatronTrainerRole(config, output_dir, placement, group)
    return TorchTrainerRole(config, torch_threads=torch_threads, placement=placement, group=group)

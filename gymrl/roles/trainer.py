"""The trainer role: the torch trainer's actor, and the driver's handles of both backends
(one torch actor, or a group of Megatron ranks) with the same five verbs.

The loop does not care whether the trainer is one torch actor or a group of Megatron ranks: it
trains a step, refits the generation server to a weight version, saves and loads checkpoints.
How weights reach the engines is `gymrl.generation.sglang.refit`'s (object store, broadcast, disk);
each role picks the transport its backend and `generation.refit.transport` call for. Every
trainer rank runs with the weight-sync NCCL settings of the SGLang servers
(`gymrl.generation.sglang.weight_sync.WEIGHT_SYNC_NCCL_ENV`), since rank 0 joins their communicator.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import ray
import torch

from gymrl.algo.trajectory import Trajectory
from gymrl.cluster.placement import Placement, actor_options
from gymrl.cluster.ray_calls import close_actor, wait_for
from gymrl.cluster.session import OnCleanup
from gymrl.config.schema.generation import RefitConfig, SGLangGenerationConfig
from gymrl.config.schema.loss import LossConfig
from gymrl.config.schema.policy import PolicyConfig
from gymrl.config.schema.recipe import RecipeConfig
from gymrl.config.schema.trainer import MegatronTrainerConfig, TorchTrainerConfig
from gymrl.generation.sglang.refit import (
    broadcast_backend,
    refit_by_broadcast,
    refit_from_disk,
    refit_through_object_store,
    weight_sender,
)
from gymrl.generation.sglang.weight_sync import WEIGHT_SYNC_NCCL_ENV, WeightSender
from gymrl.model.policy import build_policy
from gymrl.model.tokens import pad_token_id
from gymrl.run.adapter import AdapterWeights
from gymrl.trainer.parity_gate import ParityCheck
from gymrl.trainer.torch_trainer import TorchPolicyTrainer


@ray.remote(num_cpus=0)
class PolicyTrainerActor:
    """The torch trainer in its own process: optimizer steps, weight export, checkpoints."""

    def __init__(
        self,
        policy: PolicyConfig,
        trainer: TorchTrainerConfig,
        loss: LossConfig,
        *,
        seed: int,
        temperature: float,
        keep_last_checkpoints: int,
        torch_threads: int,
        device: str,
    ):
        self._served_dtype = policy.dtype
        """`device`: `cuda` when the placement gave this actor a GPU (Ray makes it the only
        visible one), else `cpu`."""
        torch.set_num_threads(torch_threads)
        torch.manual_seed(seed)
        self._device = device
        self._sender: WeightSender | None = None
        model, tokenizer = build_policy(policy, seed)
        # transformers' `to` is typed as unbound (see gymrl.model.loading.build_tiny_llama).
        model.to(device)  # pyright: ignore[reportArgumentType]
        self._trainer = TorchPolicyTrainer(
            model,
            trainer,
            loss,
            temperature=temperature,
            pad_token_id=pad_token_id(tokenizer),
            keep_last_checkpoints=keep_last_checkpoints,
            compute_dtype=policy.compute_dtype,
        )

    def train_step(
        self,
        trajectories: list[Trajectory],
        advantages: torch.Tensor,
        parity: ParityCheck | None = None,
    ) -> dict:
        return self._trainer.train_step(trajectories, advantages, parity)

    def export_weights(
        self, dtypes: Mapping[str, torch.dtype] | None = None
    ) -> Mapping[str, torch.Tensor]:
        return self._trainer.export_weights(dtypes)

    def export_adapter(self) -> AdapterWeights:
        return self._trainer.export_adapter()

    def send_weights(
        self, urls: list[str], tp_sizes: list[int], refit: RefitConfig, version: int
    ) -> int:
        """Broadcast the weights to the SGLang servers (paused by the generation server); the
        weight-update group is formed on the first call and kept."""
        if self._sender is None:
            self._sender = weight_sender(
                urls,
                tp_sizes,
                refit,
                master_address=ray.util.get_node_ip_address(),
                backend=broadcast_backend(self._device),
                served_dtype=self._served_dtype,
            )
        self._sender.send(self._trainer.export_weights().items(), version)
        return self._sender.bytes_sent

    def weight_version(self) -> int:
        return self._trainer.weight_version

    def compute_dtype(self) -> str:
        return self._trainer.compute_dtype

    def save_checkpoint(self, directory: str, step: int, data_state: dict) -> str:
        return str(self._trainer.save_checkpoint(Path(directory), step, data_state))

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        return self._trainer.load_checkpoint(Path(path))


class TrainerRole(Protocol):
    def wait_until_started(self) -> None:
        """Return once the trainer can train (with its start deadline); a role may start in the
        background from its construction until then."""
        ...

    def train_step(
        self,
        trajectories: list[Trajectory],
        advantages: torch.Tensor,
        parity: ParityCheck | None = None,
    ) -> dict:
        """One optimizer step; `parity` is checked before its update (gymrl.trainer.parity_gate)."""
        ...

    def refit(self, generation: Any, version: int) -> None: ...

    def save_checkpoint(self, directory: Path, step: int, data_state: dict) -> None: ...

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        """Restore and return at least `step` and `data_state`."""
        ...

    def compute_dtype(self) -> str:
        """What the trainer computes log-probabilities in, `float32` or `bfloat16` (the parity
        gate's tolerance depends on it)."""
        ...

    def close(self) -> None:
        """End every process and GPU reservation the role holds."""
        ...


class TorchTrainerRole:
    def __init__(
        self, config: RecipeConfig, *, torch_threads: int, placement: Placement, group: Any
    ):
        self._timeout_s = config.grpo.batch_timeout_s
        self._policy_dtype = config.policy.dtype
        generation = config.generation
        self._refit = generation.refit if isinstance(generation, SGLangGenerationConfig) else None
        self._lora = config.trainer.lora.enabled
        # The engine's weight dtypes (None: SGLang's, which load any), asked at the first refit.
        self._engine_dtypes: Mapping[str, torch.dtype] | None = None
        self._engine_dtypes_asked = False
        role = placement.trainer
        options = actor_options(role, 0, group, env_vars=dict(WEIGHT_SYNC_NCCL_ENV))
        self._actor = PolicyTrainerActor.options(**options).remote(
            config.policy,
            config.trainer,
            config.loss,
            seed=config.run.seed,
            temperature=config.generation.sampling.temperature,
            keep_last_checkpoints=config.checkpoint.keep_last,
            torch_threads=torch_threads,
            device=role.device,
        )
        # The actor builds its model in the background; `wait_until_started` waits for it.
        self._started = self._actor.weight_version.remote()  # answers once the model is built
        self._start_timeout_s = config.trainer.start_timeout_s

    def wait_until_started(self) -> None:
        wait_for(
            self._started,
            timeout_s=self._start_timeout_s,
            what="starting the torch trainer (trainer.start_timeout_s)",
        )

    def train_step(
        self,
        trajectories: list[Trajectory],
        advantages: torch.Tensor,
        parity: ParityCheck | None = None,
    ) -> dict:
        return self._wait(
            self._actor.train_step.remote(trajectories, advantages, parity), "a train step"
        )

    def refit(self, generation: Any, version: int) -> None:
        if self._lora:  # the adapter alone: merged by the torch engine, loaded by SGLang's
            adapter = self._actor.export_adapter.remote()  # stays in the object store
            self._wait(generation.update_adapter.remote(adapter, version), "the adapter refit")
            return
        if self._refit is not None and self._refit.transport == "nccl":
            refit = self._refit

            def send(urls: list[str], tp_sizes: list[int]) -> None:
                ref = self._actor.send_weights.remote(urls, tp_sizes, refit, version)
                self._wait(ref, "the weight broadcast")

            refit_by_broadcast(generation, version, send, self._wait)
            return
        if not self._engine_dtypes_asked:
            self._engine_dtypes = self._wait(
                generation.weight_dtypes.remote(), "the engine's weight dtypes"
            )
            self._engine_dtypes_asked = True
        # Exported in the engine's dtypes, so a bfloat16 body crosses at half the bytes; stays
        # in the object store.
        weights = self._actor.export_weights.remote(self._engine_dtypes)
        refit_through_object_store(generation, version, weights, self._wait)

    def save_checkpoint(self, directory: Path, step: int, data_state: dict) -> None:
        self._wait(
            self._actor.save_checkpoint.remote(str(directory), step, data_state), "a checkpoint"
        )

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        return self._wait(self._actor.load_checkpoint.remote(str(path)), "loading a checkpoint")

    def compute_dtype(self) -> str:
        """policy.compute_dtype as the actor resolved it on its device; policy.dtype bfloat16
        rounds the weights themselves."""
        resolved = self._wait(self._actor.compute_dtype.remote(), "the trainer's compute dtype")
        return "bfloat16" if self._policy_dtype == "bfloat16" else resolved

    def close(self) -> None:
        close_actor(self._actor)  # nothing to flush: checkpoints are written when asked for

    def _wait(self, ref: Any, what: str) -> Any:
        return wait_for(ref, timeout_s=self._timeout_s, what=what)


class MegatronTrainerRole:
    def __init__(self, config: RecipeConfig, output_dir: Path, placement: Placement, group: Any):
        from gymrl.trainer.megatron.group import MegatronTrainerGroup  # needs CUDA + megatron

        self._refit_dir = output_dir / "refit"
        self._timeout_s = config.grpo.batch_timeout_s
        self._policy_dtype = config.policy.dtype
        self._lora = config.trainer.lora.enabled
        generation = config.generation
        # Every weight reaches SGLang alone; a LoRA run's adapter reaches either engine (the
        # validator's rules).
        assert self._lora or isinstance(generation, SGLangGenerationConfig)
        self._refit = generation.refit if isinstance(generation, SGLangGenerationConfig) else None
        self._group = MegatronTrainerGroup(
            config,
            placement_group=group,
            ranks=placement.trainer,
            temperature=config.generation.sampling.temperature,
            start_timeout_s=config.trainer.start_timeout_s,
            call_timeout_s=config.grpo.batch_timeout_s,
        )

    def wait_until_started(self) -> None:
        """The group's constructor waited for its ranks."""

    def train_step(
        self,
        trajectories: list[Trajectory],
        advantages: torch.Tensor,
        parity: ParityCheck | None = None,
    ) -> dict:
        return self._group.train_step(trajectories, advantages, parity)

    def refit(self, generation: Any, version: int) -> None:
        if self._lora:  # the adapter alone, in PEFT's format, as the torch trainer's
            adapter = self._group.export_adapter()
            self._wait(generation.update_adapter.remote(adapter, version), "the adapter refit")
            return
        assert self._refit is not None  # SGLang's, by the assertion in __init__
        if self._refit.transport == "nccl":
            refit = self._refit
            refit_by_broadcast(
                generation,
                version,
                lambda urls, tp_sizes: self._group.send_weights(urls, tp_sizes, refit, version),
                self._wait,
            )
            return
        refit_from_disk(
            generation, version, self._group.export_hf_checkpoint, self._refit_dir, self._wait
        )

    def _wait(self, ref: Any, what: str) -> Any:
        return wait_for(ref, timeout_s=self._timeout_s, what=what)

    def save_checkpoint(self, directory: Path, step: int, data_state: dict) -> None:
        self._group.save_checkpoint(directory, step, data_state)

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        return self._group.load_checkpoint(path)

    def compute_dtype(self) -> str:
        """Megatron (and SGLang) compute in policy.dtype."""
        return self._policy_dtype

    def close(self) -> None:
        self._group.shutdown()


def start_trainer(
    config: RecipeConfig,
    output_dir: Path,
    *,
    torch_threads: int,
    placement: Placement,
    group: Any,
    on_cleanup: OnCleanup,
) -> TrainerRole:
    """The trainer of `config`, its actors placed as `placement` says, in the run's placement
    `group` (`gymrl.cluster.placement.reserve`), its closer registered; it may still be starting
    (`TrainerRole.wait_until_started`)."""
    if isinstance(config.trainer, MegatronTrainerConfig):
        role: TrainerRole = MegatronTrainerRole(config, output_dir, placement, group)
    else:
        role = TorchTrainerRole(
            config, torch_threads=torch_threads, placement=placement, group=group
        )
    on_cleanup("the trainer", role.close)
    return role

"""One rank of Megatron GRPO training (one GPU): building the model, the train step and the
log-probability pass. See the package docstring for how a step is planned and scaled."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch

from gymrl.algo.trajectory import Trajectory
from gymrl.config.schema.generation import RefitConfig
from gymrl.config.schema.recipe import RecipeConfig
from gymrl.generation.sglang.refit import broadcast_backend, weight_sender
from gymrl.generation.sglang.weight_sync import WeightSender
from gymrl.model.policy import model_folder
from gymrl.run.adapter import AdapterWeights
from gymrl.run.checkpoint import TrainerState, capture_rng_state, restore_rng_state
from gymrl.trainer.grpo_step import loss_normalizer, micro_batch_loss, reduce_loss_metrics
from gymrl.trainer.megatron.arguments import (
    ddp_config_kwargs,
    lora_kwargs,
    megatron_config,
    megatron_loss_scale,
    optimizer_config_kwargs,
    parallel_state_kwargs,
    provider_overrides,
    scheduler_kwargs,
    sequence_multiple,
    unsupported_settings,
)
from gymrl.trainer.megatron.batches import (
    MicroBatch,
    build_micro_batch,
    context_parallel_positions,
    plan_micro_batches,
)
from gymrl.trainer.megatron.checkpointing import (
    export_hf_checkpoint,
    load_distributed_checkpoint,
    save_distributed_checkpoint,
)
from gymrl.trainer.megatron.distributed import DIST_TIMEOUT, local_rank_from_env
from gymrl.trainer.megatron.logprobs import token_logprobs
from gymrl.trainer.megatron.router_replay import install_route_replay, local_routes, set_routes
from gymrl.trainer.parity_gate import PASSED_METRIC, ParityCheck, ParityGateError

NOTHING_TRAINED = {"num_tokens": 0.0, "num_sequences": 0.0}


class MegatronPolicyTrainer:
    """One rank of Megatron GRPO training (one GPU). All ranks receive the same calls.

    `temperature` must be the sampling temperature of the generation engines: the trainer
    recomputes log-probabilities under the same temperature-scaled distribution.
    """

    def __init__(self, config: RecipeConfig, *, temperature: float) -> None:
        problems = unsupported_settings(config)
        if problems:
            raise ValueError("cannot train with Megatron: " + "; ".join(problems))
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 (the sampler's), got {temperature}")
        from megatron.bridge import AutoBridge
        from megatron.core import parallel_state
        from megatron.core.distributed import (
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.utils import get_model_config

        self._config = config
        self._trainer = megatron_config(config)
        self._temperature = temperature
        torch.cuda.set_device(local_rank_from_env())
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group("nccl", timeout=DIST_TIMEOUT)
        parallel_state.initialize_model_parallel(**parallel_state_kwargs(self._trainer))
        model_parallel_cuda_manual_seed(config.run.seed)
        self._ps = parallel_state

        # The policy's checkpoint folder whatever its source (the embedded SmolLM2 converted).
        self._policy_folder = model_folder(config.policy)
        self._bridge = AutoBridge.from_hf_pretrained(self._policy_folder)
        provider = self._bridge.to_megatron_provider(load_weights=True)
        for name, value in provider_overrides(config).items():
            setattr(provider, name, value)
        if self._trainer.transformer_impl == "local":
            # Bridge's providers default to TE layers, whatever transformer_impl says.
            from megatron.bridge.models.gpt_provider import local_layer_spec

            provider.transformer_layer_spec = local_layer_spec
        provider.finalize()
        self._lora: Any = None  # megatron-bridge's LoRA, with trainer.lora
        if self._trainer.lora.enabled:
            from megatron.bridge.peft.lora import LoRA

            # After the weights load (the provider's first hook) and before DDP wraps the
            # model: LoRA freezes every base weight, so DDP's gradient buffers and the
            # distributed optimizer hold the adapter's parameters alone.
            self._lora = LoRA(**lora_kwargs(config))
            provider.register_pre_wrap_hook(partial(self._lora, training=True))
        self._model = provider.provide_distributed_model(
            ddp_config=DistributedDataParallelConfig(**ddp_config_kwargs(self._trainer)),
            wrap_with_ddp=True,
        )
        self._optimizer = get_megatron_optimizer(
            OptimizerConfig(**optimizer_config_kwargs(config)), self._model
        )
        self._scheduler = OptimizerParamScheduler(self._optimizer, **scheduler_kwargs(config))
        model_config = get_model_config(self._model[0])
        model_config.finalize_model_grads_func = finalize_model_grads
        model_config.grad_scale_func = self._optimizer.scale_loss
        self._vocab_size = self._bridge.hf_pretrained.config.vocab_size
        self._route_replays = (
            install_route_replay(self._model) if config.policy.router_replay.enabled else []
        )
        self._normalizer = 1.0
        self._loss_scale = 1.0
        self.weight_version = 0
        self._sender: WeightSender | None = None  # rank 0, once weights are broadcast

    # ------------------------------------------------------------------------- identities
    @property
    def rank(self) -> int:
        return torch.distributed.get_rank()

    def ready(self) -> int:
        """This rank's global rank, once construction finished (Ray callers wait on it)."""
        return self.rank

    def is_reporting_rank(self) -> bool:
        """One rank per data-parallel replica reports metrics: last pipeline stage, TP and CP
        rank 0 (the others hold the same values)."""
        ps = self._ps
        return (
            ps.is_pipeline_last_stage(ignore_virtual=True)
            and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_context_parallel_rank() == 0
        )

    # ----------------------------------------------------------------------------- training
    def train_step(
        self,
        trajectories: Sequence[Trajectory],
        advantages: torch.Tensor,
        parity: ParityCheck | None = None,
    ) -> dict[str, float]:
        """One optimizer step. Returns this rank's metrics (empty on non-reporting ranks).
        `parity` is checked before the update (:meth:`_check_parity`)."""
        if advantages.shape != (len(trajectories),):
            raise ValueError(
                f"advantages must have shape [{len(trajectories)}], got {list(advantages.shape)}"
            )
        token_level = self._config.loss.token_level_normalization
        self._normalizer = loss_normalizer(trajectories, token_level)
        if self._normalizer == 0:  # every trajectory masked: nothing to learn, no update
            return NOTHING_TRAINED if self.is_reporting_rank() else {}
        plan = self._own_plan(trajectories)
        batches = [
            (build_micro_batch(trajectories, advantages, mb), _row_agents(trajectories, mb))
            for mb in plan
        ]
        ps = self._ps
        self._loss_scale = megatron_loss_scale(
            len(batches), ps.get_data_parallel_world_size(), ps.get_context_parallel_world_size()
        )
        for chunk in self._model:
            chunk.train()
            chunk.zero_grad_buffer()
        self._optimizer.zero_grad()
        outputs = self._forward_backward(batches, self._loss_step, forward_only=False)
        checked = {} if parity is None else self._check_parity(parity, outputs)
        update_successful, grad_norm, _ = self._optimizer.step()
        if not update_successful:  # only fp16 loss scaling skips steps; this trainer uses bf16
            raise RuntimeError("Megatron's optimizer skipped the update (inf/NaN gradients)")
        self._scheduler.step(increment=1)
        self.weight_version += 1
        if not self.is_reporting_rank():
            return {}
        metrics = reduce_loss_metrics(outputs)
        metrics["num_sequences"] = float(
            sum(
                1
                for micro_batch in plan
                for index in micro_batch.indices
                if index is not None and trajectories[index].num_generated_tokens > 0
            )
        )
        metrics["grad_norm"] = float(grad_norm)
        metrics["lr"] = float(self._optimizer.param_groups[0]["lr"])
        return metrics | checked

    def _check_parity(self, parity: ParityCheck, outputs: list[Any]) -> dict[str, float]:
        """Apply `parity` before the update. Every rank applies it to the same figures (the
        reporting ranks' metrics gathered from all and merged), so either all ranks raise,
        leaving the weights as they were, or all take the step."""
        mine = reduce_loss_metrics(outputs) if outputs and self.is_reporting_rank() else None
        everyone: list[dict[str, float] | None] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, mine)
        step_metrics = reduce_loss_metrics([report for report in everyone if report])
        try:
            return {PASSED_METRIC: float(parity(step_metrics))}
        except ParityGateError:
            self._optimizer.zero_grad()  # this batch is never trained on
            raise

    def compute_logprobs(self, trajectories: Sequence[Trajectory]) -> dict[int, list[float]]:
        """Current-policy log-probabilities of each trajectory's tokens (aligned like
        `token_ids`, position 0 is 0.0), keyed by index; only reporting ranks return theirs."""
        advantages = torch.zeros(len(trajectories))
        plan = self._own_plan(trajectories)
        batches = [
            (build_micro_batch(trajectories, advantages, mb), _row_agents(trajectories, mb))
            for mb in plan
        ]
        for chunk in self._model:
            chunk.eval()
        with torch.no_grad():
            outputs = self._forward_backward(batches, self._logprob_step, forward_only=True)
        if not self.is_reporting_rank():
            return {}
        found: dict[int, list[float]] = {}
        for micro_batch, rows in zip(plan, outputs, strict=True):
            for index, row in zip(micro_batch.indices, rows, strict=True):
                if index is not None:
                    found[index] = row[: len(trajectories[index].token_ids)]
        return found

    def _own_plan(self, trajectories: Sequence[Trajectory]) -> list[MicroBatch]:
        plans = plan_micro_batches(
            [len(t.token_ids) for t in trajectories],
            data_parallel_size=self._ps.get_data_parallel_world_size(),
            micro_batch_size=self._trainer.micro_batch_size,
            sequence_multiple=sequence_multiple(self._trainer),
            uniform_shapes=self._trainer.pipeline_model_parallel_size > 1,
        )
        return plans[self._ps.get_data_parallel_rank()]

    def _forward_backward(self, batches, step_fn, *, forward_only: bool) -> list[Any]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        forward_backward = get_forward_backward_func()
        try:
            return forward_backward(
                forward_step_func=partial(self._forward_step, step_fn),
                data_iterator=iter(batches),
                model=self._model,
                num_microbatches=len(batches),
                seq_length=batches[0][0]["input_ids"].shape[1],
                micro_batch_size=batches[0][0]["input_ids"].shape[0],
                forward_only=forward_only,
            )
        finally:  # no later forward (an export, a check) replays this step's routes
            set_routes(self._route_replays, None)

    def _forward_step(self, step_fn, data_iterator, model):
        """`data_iterator` yields (micro-batch tensors, the agent of each row)."""
        tensors, agents = next(data_iterator)
        batch = {k: v.cuda(non_blocking=True) for k, v in tensors.items()}
        ps = self._ps
        local = context_parallel_positions(
            batch["input_ids"].shape[1],
            ps.get_context_parallel_world_size(),
            ps.get_context_parallel_rank(),
        ).cuda()
        input_ids = batch["input_ids"].index_select(1, local)
        position_ids = batch["position_ids"].index_select(1, local)
        if self._route_replays:
            self._replay_routes(batch, local)
        # Causal attention over right-padded rows needs no mask: no real token sees padding.
        output = model(input_ids, position_ids, None)
        return output, partial(step_fn, batch, agents, local)

    def _replay_routes(self, batch: Mapping[str, torch.Tensor], local: torch.Tensor) -> None:
        """Give every router this micro-batch's routes for the tokens it sees (kept until the
        next micro-batch's, so a recomputation in the backward pass replays them too)."""
        if "routed_experts" not in batch:  # no row collected any: the live router decides
            set_routes(self._route_replays, None)
            return
        ps = self._ps
        sequence_parallel = self._trainer.sequence_parallel
        tokens = local_routes(
            batch["routed_experts"],
            local,
            sequence_parallel_rank=ps.get_tensor_model_parallel_rank()
            if sequence_parallel
            else None,
            sequence_parallel_size=ps.get_tensor_model_parallel_world_size(),
        )
        set_routes(self._route_replays, tokens)

    def _token_logprobs(self, batch, local, logits: torch.Tensor) -> torch.Tensor:
        return token_logprobs(
            self._ps,
            logits,
            batch["labels"].index_select(1, local),
            temperature=self._temperature,
            vocab_size=self._vocab_size,
        )

    def _loss_step(self, batch, agents, local, logits):
        logprobs = self._token_logprobs(batch, local, logits)
        loss, metrics = micro_batch_loss(
            logprobs, batch, self._config.loss, normalizer=self._normalizer, agents=agents
        )
        return loss * self._loss_scale, metrics

    def _logprob_step(self, batch, agents, local, logits):
        logprobs = self._token_logprobs(batch, local, logits)
        return logprobs.new_zeros(()), logprobs.cpu().tolist()

    # ------------------------------------------------------------------------------- weights
    def export_weights(self) -> dict[str, torch.Tensor]:
        """Full weights with Hugging Face names, on the CPU of every rank (collective). For
        models that fit in host memory; large ones refit through :meth:`export_hf_checkpoint`.

        A snapshot: where the parameters already live on the CPU, Bridge hands back the live
        parameter of every weight it maps one to one (`.cpu()` copies only from a GPU), which
        the next optimizer step would overwrite; those are cloned.
        """
        live = {
            param.untyped_storage().data_ptr()
            for chunk in self._model
            for param in chunk.parameters()
        }
        return {
            name: weight.clone() if weight.untyped_storage().data_ptr() in live else weight
            for name, weight in self._bridge.export_hf_weights(
                self._model, cpu=True, show_progress=False
            )
        }

    def export_adapter(self) -> AdapterWeights:
        """The LoRA adapter in PEFT's format (collective; every rank returns it): Hugging Face
        module names and PEFT's keys, so the adapter refit, the checkpoint's PEFT files and the
        engines take it as they take the torch trainer's.

        megatron-bridge exports a fused module's adapter (linear_qkv, linear_fc1) as one entry
        per Hugging Face module: its B split along the fused output, its A repeated. Each tensor
        is a copy: on a CPU the export hands back live parameters, which the next step would
        overwrite, and safetensors refuses one storage under several keys.
        """
        if self._lora is None:
            raise ValueError("export_adapter needs trainer.lora.enabled=true (no adapter)")
        from megatron.bridge.models.conversion.peft_bridge import (
            convert_adapter_weights_to_peft_state,
        )

        exported = self._bridge.export_adapter_weights(self._model, cpu=True, show_progress=False)
        tensors, _, _ = convert_adapter_weights_to_peft_state(exported)
        return AdapterWeights(
            config=self._adapter_config(),
            tensors={name: tensor.detach().clone() for name, tensor in tensors.items()},
        )

    def _adapter_config(self) -> dict[str, Any]:
        """PEFT's `adapter_config.json` fields of this run's adapter (megatron-bridge's own,
        `build_adapter_config_dict`), with the configured Hugging Face target names."""
        from megatron.bridge.models.conversion.peft_bridge import build_adapter_config_dict

        return build_adapter_config_dict(
            self._lora,
            target_modules=sorted(self._trainer.lora.target_modules),
            base_model_name_or_path=str(self._policy_folder),
        )

    def export_hf_checkpoint(self, directory: str | os.PathLike[str]) -> str:
        """A Hugging Face checkpoint in `directory`, for SGLang's refit (collective)."""
        return export_hf_checkpoint(self._bridge, self._model, directory)

    def send_weights(
        self, urls: list[str], tp_sizes: list[int], refit: RefitConfig, version: int
    ) -> int:
        """Broadcast the Hugging Face weights to the SGLang servers (collective: every rank
        exports, rank 0 sends each tensor as it comes, so no rank holds the whole model twice).
        Rank 0 forms the weight-update group on the first call, over NCCL from GPUs and gloo
        where the model lives on the CPU; returns the bytes it sent."""
        weights = self._bridge.export_hf_weights(self._model, cpu=False, show_progress=False)
        if self.rank != 0:
            for _ in weights:  # the export's gathers need every rank
                pass
            return 0
        if self._sender is None:
            import ray

            self._sender = weight_sender(
                urls,
                tp_sizes,
                refit,
                master_address=ray.util.get_node_ip_address(),
                backend=broadcast_backend(next(self._model[0].parameters()).device),
                served_dtype=self._config.policy.dtype,
            )
        self._sender.send(weights, version)
        return self._sender.bytes_sent

    # --------------------------------------------------------------------------- checkpoints
    def save_checkpoint(
        self, directory: str | os.PathLike[str], step: int, data_state: Mapping[str, Any]
    ) -> str:
        """Model, distributed optimizer, scheduler, weight version, data position and every
        rank's RNG states (collective). Keeps the newest `checkpoint.keep_last`."""
        rng: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(rng, capture_rng_state())
        state = TrainerState(
            step=step,
            weight_version=self.weight_version,
            data_state=dict(data_state),
            rng=rng,
            extra={"scheduler": self._scheduler.state_dict()},
        )
        return save_distributed_checkpoint(
            directory,
            self._model,
            self._optimizer,
            state,
            keep_last=self._config.checkpoint.keep_last,
            adapter=None if self._lora is None else self.export_adapter(),
        )

    def load_checkpoint(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Restore everything :meth:`save_checkpoint` wrote (collective); return the resume
        info `{"step", "weight_version", "data_state", "extra"}`."""
        state = load_distributed_checkpoint(
            path,
            self._model,
            self._optimizer,
            adapter_config=None if self._lora is None else self._adapter_config(),
        )
        self._scheduler.load_state_dict(state.extra["scheduler"])
        self.weight_version = state.weight_version
        restore_rng_state(state.rng[self.rank])
        return state.resume_info()


def _row_agents(trajectories: Sequence[Trajectory], micro_batch: MicroBatch) -> list[str]:
    """The agent of each row of `micro_batch` ("" for a filler row, which has no token)."""
    return ["" if i is None else trajectories[i].agent for i in micro_batch.indices]

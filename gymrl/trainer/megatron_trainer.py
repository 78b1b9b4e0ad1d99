"""GRPO training with Megatron-core on GPU clusters, one process per GPU, started as Ray actors.

Megatron-core and Megatron-Bridge need CUDA, so they are imported inside the methods that use
them; everything from config to Megatron arguments, micro-batch planning, the context-parallel
layout and metric reduction is a pure function, covered by CPU tests.

How a rank is built (:class:`MegatronPolicyTrainer`):

1. `torch.distributed` from the environment (`MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE`,
   `LOCAL_RANK`; :class:`MegatronTrainerGroup` sets them), then
   `parallel_state.initialize_model_parallel` with TP/PP/CP/EP/ETP from the config.
2. The model from the Hugging Face checkpoint through Megatron-Bridge
   (`AutoBridge.from_hf_pretrained(path).to_megatron_provider(load_weights=True)`, parallelism,
   precision and recomputation set on the provider, `provide_distributed_model` wrapping it in
   Megatron's `DistributedDataParallel`).
3. `get_megatron_optimizer` with the distributed optimizer (Adam with decoupled weight decay, i.e.
   AdamW; biases and norms get no weight decay, Megatron's convention) and a constant-rate
   `OptimizerParamScheduler`, which is what writes the learning rate and per-group weight decay.

One `train_step` is one optimizer step over every trajectory of the batch:

* **Planning.** Trajectories are dealt to data-parallel ranks in snake order of length (equal
  counts, balanced tokens), split into micro-batches of `micro_batch_size`, every rank running
  the same number of micro-batches (expert-parallel all-to-alls span data-parallel ranks, so a
  rank with fewer would hang the others; a filler micro-batch trains on nothing). Sequences are
  padded to a multiple of `2 x CP` (Megatron's load-balanced context-parallel split needs two
  chunks per rank) times `TP` under sequence parallelism; with pipeline parallelism every
  micro-batch has one shape, since stages exchange fixed-size activations.
* **Log-probabilities.** The output layer's logits are split over the vocabulary across TP
  ranks; `tensor_parallel.vocab_parallel_cross_entropy` (its negative) gives each position's
  log-probability of the next token without gathering the vocabulary. Logits are divided by the
  sampler's temperature first: generation log-probabilities are those of the temperature-scaled
  distribution, and the importance ratio must compare like with like. Under context parallelism
  each rank holds two chunks of every sequence; the per-token log-probabilities (not the logits)
  are all-gathered with an autograd-aware all-gather and put back in order, so the GRPO loss,
  including per-sequence normalisation, sees whole sequences.
* **Loss.** `gymrl.algo.loss.grpo_loss` with the normaliser of the whole step (all tokens or all
  sequences of every rank), so summed gradients equal the full-batch gradient. Megatron divides a
  micro-batch loss by the number of micro-batches and averages gradients over data-parallel ranks
  (summing over context-parallel ones); the returned loss is multiplied back by
  `num_microbatches x DP / CP` (:func:`megatron_loss_scale`; `/ CP` because every CP rank
  computes the same whole-sequence loss).

Refit: :meth:`MegatronPolicyTrainer.export_hf_checkpoint` writes a Hugging Face checkpoint with
`AutoBridge.save_hf_pretrained` (collective; rank 0 writes), which SGLang then loads with
`/update_weights_from_disk` (`gymrl.generation.sglang_engine.SGLangEngine.refit_from_disk`).
Checkpoints use Megatron's distributed checkpointing (`dist_checkpointing.save/load` of the
model's and the distributed optimizer's sharded state dicts).

Unsupported here, refused at construction with the fix: a KL term (it needs a reference model,
a second full copy of the weights per rank) and MoE router replay (trajectories carry no routing
decisions yet).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch

from gymrl.algo.loss import grpo_loss
from gymrl.algo.trajectory import Trajectory, collate
from gymrl.checkpoint import COMPLETE_MARKER, STATE_FILE, complete_checkpoints
from gymrl.config.schema import MegatronTrainerConfig, RecipeConfig
from gymrl.config.validate import unsupported_by_trainer

PAD_TOKEN_ID = 0  # any valid id: padding sits after every real token and is masked out
_DIST_TIMEOUT = timedelta(minutes=30)
_MEGATRON_CKPT_DIR = "megatron"
_NOTHING_TRAINED = {"num_tokens": 0.0, "num_sequences": 0.0}
_FILLER = Trajectory(
    token_ids=[PAD_TOKEN_ID],
    loss_mask=[0],
    generation_logprobs=[0.0],
    reward=0.0,
    agent="",
    group_id="filler",
    weight_version=0,
)


# ------------------------------------------------------------------------- config -> Megatron
def parallel_state_kwargs(trainer: MegatronTrainerConfig) -> dict[str, Any]:
    """Arguments of `megatron.core.parallel_state.initialize_model_parallel`."""
    return {
        "tensor_model_parallel_size": trainer.tensor_model_parallel_size,
        "pipeline_model_parallel_size": trainer.pipeline_model_parallel_size,
        "virtual_pipeline_model_parallel_size": None,
        "context_parallel_size": trainer.context_parallel_size,
        "expert_model_parallel_size": trainer.expert_model_parallel_size,
        "expert_tensor_parallel_size": trainer.expert_tensor_parallel_size,
    }


def provider_overrides(config: RecipeConfig) -> dict[str, Any]:
    """Attributes set on the Megatron-Bridge model provider (a `TransformerConfig`).

    Parallelism must match `parallel_state`; `calculate_per_token_loss=False` because the GRPO
    loss does its own normalisation (:func:`megatron_loss_scale`); full uniform recomputation of
    every layer when activation checkpointing is on (long agentic episodes dominate memory).
    """
    trainer = _megatron(config)
    bf16 = config.policy.dtype == "bfloat16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    overrides = parallel_state_kwargs(trainer) | {
        "sequence_parallel": trainer.sequence_parallel,
        "bf16": bf16,
        "fp16": False,
        "params_dtype": dtype,
        "pipeline_dtype": dtype,
        "seq_length": config.policy.max_total_sequence_length,
        "calculate_per_token_loss": False,
        "variable_seq_lengths": False,
    }
    if trainer.activation_checkpointing:
        overrides |= {
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
        }
    return overrides


def ddp_config_kwargs(trainer: MegatronTrainerConfig) -> dict[str, Any]:
    """Arguments of `megatron.core.distributed.DistributedDataParallelConfig`.

    `average_in_collective=False` keeps Megatron's "scale by 1/DP, sum over DP x CP" reduction,
    which :func:`megatron_loss_scale` undoes; gradients are reduced in fp32.
    """
    del trainer  # the same for every layout; the parameter keeps the call sites uniform
    return {
        "grad_reduce_in_fp32": True,
        "overlap_grad_reduce": False,
        "overlap_param_gather": False,
        "use_distributed_optimizer": True,
        "average_in_collective": False,
        "check_for_nan_in_grad": True,
    }


def optimizer_config_kwargs(config: RecipeConfig) -> dict[str, Any]:
    """Arguments of `megatron.core.optimizer.OptimizerConfig` (Adam = AdamW in Megatron)."""
    optimizer = _megatron(config).optimizer
    bf16 = config.policy.dtype == "bfloat16"
    return {
        "optimizer": "adam",
        "lr": optimizer.lr,
        "min_lr": optimizer.lr,
        "weight_decay": optimizer.weight_decay,
        "adam_beta1": optimizer.betas[0],
        "adam_beta2": optimizer.betas[1],
        "adam_eps": optimizer.eps,
        "clip_grad": optimizer.max_grad_norm,
        "bf16": bf16,
        "fp16": False,
        "params_dtype": torch.bfloat16 if bf16 else torch.float32,
        "use_distributed_optimizer": True,
    }


def scheduler_kwargs(config: RecipeConfig) -> dict[str, Any]:
    """Arguments of `megatron.core.optimizer_param_scheduler.OptimizerParamScheduler`: a
    constant learning rate and weight decay (it also applies the no-decay groups' `wd_mult`)."""
    optimizer = _megatron(config).optimizer
    steps = max(config.grpo.num_steps, 1)
    return {
        "init_lr": optimizer.lr,
        "max_lr": optimizer.lr,
        "min_lr": optimizer.lr,
        "lr_warmup_steps": 0,
        "lr_decay_steps": steps,
        "lr_decay_style": "constant",
        "start_wd": optimizer.weight_decay,
        "end_wd": optimizer.weight_decay,
        "wd_incr_steps": steps,
        "wd_incr_style": "constant",
    }


def unsupported_settings(config: RecipeConfig) -> list[str]:
    """What the Megatron trainer cannot do for `config`, each with its fix (empty: fine). The
    rules live with the config validator, which reports them at composition time."""
    return [issue.render() for issue in unsupported_by_trainer(config)]


def sequence_multiple(trainer: MegatronTrainerConfig) -> int:
    """Sequence lengths must be a multiple of this: `2 x CP` chunks under context parallelism,
    times `TP` under sequence parallelism (each TP rank holds an equal slice)."""
    multiple = 2 * trainer.context_parallel_size if trainer.context_parallel_size > 1 else 1
    if trainer.sequence_parallel:
        multiple *= trainer.tensor_model_parallel_size
    return multiple


def data_parallel_size(world_size: int, trainer: MegatronTrainerConfig) -> int:
    if world_size % trainer.model_parallel_size:
        raise ValueError(
            f"{world_size} trainer GPUs are not a multiple of TP x PP x CP = "
            f"{trainer.model_parallel_size}; change the parallel sizes or the GPU count"
        )
    return world_size // trainer.model_parallel_size


def megatron_loss_scale(
    num_microbatches: int, data_parallel_size: int, context_parallel_size: int
) -> float:
    """Factor that turns a micro-batch's share of the full-batch loss into what Megatron expects.

    Megatron divides each micro-batch loss by `num_microbatches`, scales gradients by `1/DP` and
    sums them over DP x CP ranks; every CP rank computes the whole-sequence loss.
    """
    return num_microbatches * data_parallel_size / context_parallel_size


def loss_normalizer(trajectories: Sequence[Trajectory], token_level: bool) -> float:
    """Denominator of the whole step's loss: generated tokens, or sequences that have any."""
    if token_level:
        return float(sum(t.num_generated_tokens for t in trajectories))
    return float(sum(1 for t in trajectories if t.num_generated_tokens > 0))


# --------------------------------------------------------------------------------- planning
@dataclass(frozen=True)
class MicroBatch:
    """Rows of one micro-batch (indices into the step's trajectories; None = a filler row that
    trains on nothing) and the padded sequence length."""

    indices: tuple[int | None, ...]
    seq_length: int


def plan_micro_batches(
    lengths: Sequence[int],
    *,
    data_parallel_size: int,
    micro_batch_size: int,
    sequence_multiple: int,
    uniform_shapes: bool,
) -> list[list[MicroBatch]]:
    """Micro-batches of every data-parallel rank (outer list indexed by DP rank).

    Zero-length (masked) trajectories are left out. Every rank gets the same number of
    micro-batches. With `uniform_shapes` (pipeline parallelism) every micro-batch has
    `micro_batch_size` rows and the step's longest padded length; otherwise rows are grouped by
    length and each micro-batch is padded to its own longest row.
    """
    if data_parallel_size < 1 or micro_batch_size < 1 or sequence_multiple < 1:
        raise ValueError(
            f"data_parallel_size={data_parallel_size}, micro_batch_size={micro_batch_size} and "
            f"sequence_multiple={sequence_multiple} must all be >= 1"
        )
    kept = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: (-lengths[i], i))
    per_rank: list[list[int]] = [[] for _ in range(data_parallel_size)]
    for position, index in enumerate(kept):
        lap, offset = divmod(position, data_parallel_size)
        rank = offset if lap % 2 == 0 else data_parallel_size - 1 - offset
        per_rank[rank].append(index)
    count = max(1, math.ceil(max(len(rows) for rows in per_rank) / micro_batch_size))
    longest = _round_up(max((lengths[i] for i in kept), default=1), sequence_multiple)
    plans = []
    for rows in per_rank:
        plan = []
        for start in range(0, count * micro_batch_size, micro_batch_size):
            chunk: list[int | None] = list(rows[start : start + micro_batch_size])
            if uniform_shapes:
                chunk += [None] * (micro_batch_size - len(chunk))
                plan.append(MicroBatch(tuple(chunk), longest))
                continue
            if not chunk:
                chunk = [None]
            own = max((lengths[i] for i in chunk if i is not None), default=1)
            plan.append(MicroBatch(tuple(chunk), _round_up(own, sequence_multiple)))
        plans.append(plan)
    return plans


def build_micro_batch(
    trajectories: Sequence[Trajectory], advantages: torch.Tensor, micro_batch: MicroBatch
) -> dict[str, torch.Tensor]:
    """The CPU tensors of one micro-batch: `gymrl.algo.trajectory.collate` padded to its length,
    plus `labels` (the next token at each position, padding at the end) and `position_ids`."""
    rows = [_FILLER if i is None else trajectories[i] for i in micro_batch.indices]
    row_advantages = torch.tensor(
        [0.0 if i is None else float(advantages[i]) for i in micro_batch.indices]
    )
    batch = collate(
        rows,
        advantages=row_advantages,
        pad_token_id=PAD_TOKEN_ID,
        max_length=micro_batch.seq_length,
    )
    labels = torch.full_like(batch["input_ids"], PAD_TOKEN_ID)
    labels[:, :-1] = batch["input_ids"][:, 1:]
    batch["labels"] = labels
    batch["position_ids"] = torch.arange(micro_batch.seq_length).expand_as(labels).contiguous()
    return batch


# ----------------------------------------------------------------------- context parallelism
def context_parallel_positions(seq_length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Positions of a sequence held by CP rank `cp_rank` in Megatron's load-balanced layout.

    The sequence is cut into `2 x cp_size` equal chunks; rank `r` holds chunks `r` and
    `2 x cp_size - 1 - r`, so each rank has an equal share of the causal attention work.
    """
    if cp_size == 1:
        return torch.arange(seq_length)
    if seq_length % (2 * cp_size):
        raise ValueError(f"seq_length={seq_length} is not a multiple of 2 x CP = {2 * cp_size}")
    chunk = seq_length // (2 * cp_size)
    first, second = cp_rank, 2 * cp_size - 1 - cp_rank
    return torch.cat(
        [
            torch.arange(first * chunk, (first + 1) * chunk),
            torch.arange(second * chunk, (second + 1) * chunk),
        ]
    )


def context_parallel_unshard(shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Inverse of the layout above along dim 1: `shards[r]` is rank r's `[B, S / CP]` piece."""
    cp_size = len(shards)
    seq_length = sum(shard.shape[1] for shard in shards)
    order = torch.cat([context_parallel_positions(seq_length, cp_size, r) for r in range(cp_size)])
    gathered = torch.cat(list(shards), dim=1)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(seq_length)
    return gathered.index_select(1, inverse.to(gathered.device))


# ---------------------------------------------------------------------------------- metrics
_SUMMED = ("loss", "pg_loss", "kl", "num_tokens")
_TOKEN_WEIGHTED = ("clip_fraction", "importance_ratio/mean", "approx_entropy")


def reduce_loss_metrics(metrics: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Combine `grpo_loss` metrics of micro-batches (or of ranks) into the step's.

    Losses were computed with the step's normaliser, so they add up; token means are weighted by
    token counts; the maximum ratio is the maximum.
    """
    if not metrics:
        raise ValueError("no metrics to reduce (no rank or micro-batch reported any)")
    tokens = sum(m["num_tokens"] for m in metrics)
    out = {key: float(sum(m[key] for m in metrics)) for key in _SUMMED}
    for key in _TOKEN_WEIGHTED:
        weighted = sum(m[key] * m["num_tokens"] for m in metrics)
        out[key] = weighted / tokens if tokens else 0.0
    # Filler micro-batches (no tokens) report a neutral 1.0, which must not mask a lower maximum.
    with_tokens = [m["importance_ratio/max"] for m in metrics if m["num_tokens"] > 0]
    out["importance_ratio/max"] = max(with_tokens, default=1.0)
    return out


# -------------------------------------------------------------------------------- the worker
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
        self._trainer = _megatron(config)
        self._temperature = temperature
        torch.cuda.set_device(_local_rank_from_env())
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group("nccl", timeout=_DIST_TIMEOUT)
        parallel_state.initialize_model_parallel(**parallel_state_kwargs(self._trainer))
        model_parallel_cuda_manual_seed(config.run.seed)
        self._ps = parallel_state

        self._bridge = AutoBridge.from_hf_pretrained(config.policy.path)
        provider = self._bridge.to_megatron_provider(load_weights=True)
        for name, value in provider_overrides(config).items():
            setattr(provider, name, value)
        provider.finalize()
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
        self._normalizer = 1.0
        self._loss_scale = 1.0

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
        self, trajectories: Sequence[Trajectory], advantages: torch.Tensor
    ) -> dict[str, float]:
        """One optimizer step. Returns this rank's metrics (empty on non-reporting ranks)."""
        if advantages.shape != (len(trajectories),):
            raise ValueError(
                f"advantages must have shape [{len(trajectories)}], got {list(advantages.shape)}"
            )
        token_level = self._config.loss.token_level_normalization
        self._normalizer = loss_normalizer(trajectories, token_level)
        if self._normalizer == 0:  # every trajectory masked: nothing to learn, no update
            return _NOTHING_TRAINED if self.is_reporting_rank() else {}
        plan = self._own_plan(trajectories)
        batches = [build_micro_batch(trajectories, advantages, mb) for mb in plan]
        ps = self._ps
        self._loss_scale = megatron_loss_scale(
            len(batches), ps.get_data_parallel_world_size(), ps.get_context_parallel_world_size()
        )
        for chunk in self._model:
            chunk.train()
            chunk.zero_grad_buffer()
        self._optimizer.zero_grad()
        outputs = self._forward_backward(batches, self._loss_step, forward_only=False)
        update_successful, grad_norm, _ = self._optimizer.step()
        if not update_successful:  # only fp16 loss scaling skips steps; this trainer uses bf16
            raise RuntimeError("Megatron's optimizer skipped the update (inf/NaN gradients)")
        self._scheduler.step(increment=1)
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
        return metrics

    def compute_logprobs(self, trajectories: Sequence[Trajectory]) -> dict[int, list[float]]:
        """Current-policy log-probabilities of each trajectory's tokens (aligned like
        `token_ids`, position 0 is 0.0), keyed by index; only reporting ranks return theirs."""
        advantages = torch.zeros(len(trajectories))
        plan = self._own_plan(trajectories)
        batches = [build_micro_batch(trajectories, advantages, mb) for mb in plan]
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
        return forward_backward(
            forward_step_func=partial(self._forward_step, step_fn),
            data_iterator=iter(batches),
            model=self._model,
            num_microbatches=len(batches),
            seq_length=batches[0]["input_ids"].shape[1],
            micro_batch_size=batches[0]["input_ids"].shape[0],
            forward_only=forward_only,
        )

    def _forward_step(self, step_fn, data_iterator, model):
        batch = {k: v.cuda(non_blocking=True) for k, v in next(data_iterator).items()}
        ps = self._ps
        local = context_parallel_positions(
            batch["input_ids"].shape[1],
            ps.get_context_parallel_world_size(),
            ps.get_context_parallel_rank(),
        ).cuda()
        input_ids = batch["input_ids"].index_select(1, local)
        position_ids = batch["position_ids"].index_select(1, local)
        # Causal attention over right-padded rows needs no mask: no real token sees padding.
        output = model(input_ids, position_ids, None)
        return output, partial(step_fn, batch, local)

    def _token_logprobs(self, batch, local, logits: torch.Tensor) -> torch.Tensor:
        """`[B, S]` log-probabilities aligned with `input_ids` (position t: token t)."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        ps = self._ps
        scaled = logits.float() / self._temperature
        # Megatron may pad the vocabulary for TP divisibility; padded entries must get no mass.
        local_vocab = scaled.shape[-1]
        start = ps.get_tensor_model_parallel_rank() * local_vocab
        if start + local_vocab > self._vocab_size:
            padded = torch.arange(start, start + local_vocab, device=scaled.device)
            scaled = scaled.masked_fill(padded >= self._vocab_size, float("-inf"))
        labels = batch["labels"].index_select(1, local)
        next_token = -vocab_parallel_cross_entropy(scaled, labels)
        if ps.get_context_parallel_world_size() > 1:
            from torch.distributed.nn.functional import all_gather

            shards = all_gather(next_token.contiguous(), group=ps.get_context_parallel_group())
            next_token = context_parallel_unshard(shards)
        first = next_token.new_zeros(next_token.shape[0], 1)
        return torch.cat([first, next_token[:, :-1]], dim=1)

    def _loss_step(self, batch, local, logits):
        logprobs = self._token_logprobs(batch, local, logits)
        loss_config = self._config.loss
        loss, metrics = grpo_loss(
            logprobs,
            batch["generation_logprobs"],
            batch["advantages"],
            batch["loss_mask"],
            clip_ratio_low=loss_config.clip_ratio_low,
            clip_ratio_high=loss_config.clip_ratio_high,
            kl_coef=0.0,
            importance_sampling_correction=loss_config.importance_sampling_correction,
            importance_ratio_cap=loss_config.importance_ratio_cap,
            token_level_normalization=loss_config.token_level_normalization,
            normalizer=self._normalizer,
        )
        return loss * self._loss_scale, metrics

    def _logprob_step(self, batch, local, logits):
        logprobs = self._token_logprobs(batch, local, logits)
        return logprobs.new_zeros(()), logprobs.cpu().tolist()

    # ------------------------------------------------------------------------------- weights
    def export_weights(self) -> dict[str, torch.Tensor]:
        """Full weights with Hugging Face names, on the CPU of every rank (collective). For
        models that fit in host memory; large ones refit through :meth:`export_hf_checkpoint`."""
        return {
            name: weight
            for name, weight in self._bridge.export_hf_weights(
                self._model, cpu=True, show_progress=False
            )
        }

    def export_hf_checkpoint(self, directory: str | os.PathLike[str]) -> str:
        """Write a Hugging Face checkpoint to `directory` (collective; written to a staging
        folder first and renamed, so a reader never sees a partial checkpoint)."""
        target = Path(directory)
        staging = target.parent / f".tmp-{target.name}"
        if self.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        torch.distributed.barrier()
        self._bridge.save_hf_pretrained(self._model, staging, show_progress=False)
        torch.distributed.barrier()
        if self.rank == 0:
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
        torch.distributed.barrier()
        return str(target)

    # --------------------------------------------------------------------------- checkpoints
    def save_checkpoint(
        self, directory: str | os.PathLike[str], step: int, data_state: Mapping[str, Any]
    ) -> str:
        """Model and distributed-optimizer state with Megatron's distributed checkpointing, plus
        `trainer_state.json` (step, data position, scheduler) and the `COMPLETE` marker written
        last (collective). Keeps the newest `checkpoint.keep_last`."""
        from megatron.core import dist_checkpointing

        root = Path(directory)
        target = root / f"step_{step}"
        staging = root / f".tmp-step_{step}"
        state = {
            "step": step,
            "data_state": dict(data_state),
            "scheduler": self._scheduler.state_dict(),
        }
        json.dumps(state)  # fails here, before anything is written, if not serialisable
        if self.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
            (staging / _MEGATRON_CKPT_DIR).mkdir(parents=True)
        torch.distributed.barrier()
        dist_checkpointing.save(
            self._sharded_state_dict(is_loading=False), str(staging / _MEGATRON_CKPT_DIR)
        )
        torch.distributed.barrier()
        if self.rank == 0:
            (staging / STATE_FILE).write_text(json.dumps(state, indent=2))
            (staging / COMPLETE_MARKER).write_text(f"{step}\n")
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
            for old in complete_checkpoints(root)[: -self._config.checkpoint.keep_last]:
                shutil.rmtree(old)
        torch.distributed.barrier()
        return str(target)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Restore model, optimizer and scheduler from a complete checkpoint (collective);
        return `{"step", "data_state"}`."""
        from megatron.core import dist_checkpointing

        folder = Path(path)
        if not (folder / COMPLETE_MARKER).is_file():
            raise FileNotFoundError(
                f"{folder} is not a complete checkpoint (no {COMPLETE_MARKER} marker); use "
                "gymrl.checkpoint.latest_checkpoint() to find the newest complete one"
            )
        loaded = dist_checkpointing.load(
            self._sharded_state_dict(is_loading=True), str(folder / _MEGATRON_CKPT_DIR)
        )
        _unwrap(self._model[0]).load_state_dict(loaded["model"])
        self._optimizer.load_state_dict(loaded["optimizer"])
        state = json.loads((folder / STATE_FILE).read_text())
        self._scheduler.load_state_dict(state["scheduler"])
        return {"step": state["step"], "data_state": state["data_state"]}

    def _sharded_state_dict(self, *, is_loading: bool) -> dict[str, Any]:
        if len(self._model) != 1:
            raise RuntimeError("checkpointing supports one model chunk (no virtual pipeline)")
        model_state = _unwrap(self._model[0]).sharded_state_dict(prefix="")
        return {
            "model": model_state,
            "optimizer": self._optimizer.sharded_state_dict(model_state, is_loading=is_loading),
        }


def _unwrap(chunk):
    """The `GPTModel` inside Megatron's DDP and mixed-precision wrappers."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    while isinstance(chunk, DistributedDataParallel | Float16Module):
        chunk = chunk.module
    return chunk


# ---------------------------------------------------------------------------- the Ray group
DIST_ENV_KEYS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def distributed_env(
    rank: int, world_size: int, master_addr: str, master_port: int
) -> dict[str, str]:
    """Environment of one trainer actor. Ray gives each actor exactly one GPU through
    `CUDA_VISIBLE_DEVICES`, so its local rank is always 0."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    return {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": "0",
    }


def node_bundles(world_size: int, gpus_per_node: int) -> list[dict[str, float]]:
    """Placement-group bundles of the trainer: whole nodes, so consecutive ranks (the TP group)
    share NVLink; `world_size` must fill them."""
    per_node = min(world_size, gpus_per_node)
    if per_node < 1 or world_size % per_node:
        raise ValueError(
            f"{world_size} trainer GPUs do not fill nodes of {gpus_per_node} GPUs; give the "
            "trainer whole nodes (or fewer GPUs than one node)"
        )
    return [{"GPU": float(per_node), "CPU": float(per_node)}] * (world_size // per_node)


def _local_rank_from_env() -> int:
    """LOCAL_RANK, after checking that `init_process_group("nccl")` has its whole env."""
    missing = [key for key in DIST_ENV_KEYS if key not in os.environ]
    if missing:
        raise RuntimeError(
            f"torch.distributed environment variables {missing} are not set; start trainer "
            "ranks with MegatronTrainerGroup (or set MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, "
            "LOCAL_RANK yourself)"
        )
    return int(os.environ["LOCAL_RANK"])


def _megatron(config: RecipeConfig) -> MegatronTrainerConfig:
    if not isinstance(config.trainer, MegatronTrainerConfig):
        raise ValueError(f"trainer.backend is {config.trainer.backend!r}, not 'megatron'")
    return config.trainer


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _node_address() -> tuple[str, int]:
    import ray

    from gymrl.generation.sglang_engine import free_port

    return ray.util.get_node_ip_address(), free_port()


class MegatronTrainerGroup:
    """The Megatron trainer as one Ray actor per trainer GPU (see `gymrl.roles`).

    Needs a running Ray cluster with the GPUs. Every call goes to all ranks (Megatron's
    collectives need them all) and waits at most `call_timeout_s`; metrics come from the
    reporting ranks (one per data-parallel replica), combined by :func:`reduce_loss_metrics`.
    """

    def __init__(
        self,
        config: RecipeConfig,
        *,
        world_size: int,
        temperature: float,
        start_timeout_s: float,
        call_timeout_s: float,
    ) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        problems = unsupported_settings(config)
        if problems:
            raise ValueError("cannot train with Megatron: " + "; ".join(problems))
        data_parallel_size(world_size, _megatron(config))
        bundles = node_bundles(world_size, config.cluster.gpus_per_node)
        self._ray = ray
        self._timeout = call_timeout_s
        strategy = "STRICT_SPREAD" if len(bundles) > 1 else "PACK"
        self._group = placement_group(bundles, strategy=strategy)
        ray.get(self._group.ready(), timeout=start_timeout_s)
        per_node = int(bundles[0]["GPU"])

        def on_bundle(index: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(
                placement_group=self._group, placement_group_bundle_index=index
            )

        address = ray.remote(num_cpus=1)(_node_address).options(scheduling_strategy=on_bundle(0))
        master_addr, master_port = ray.get(address.remote(), timeout=start_timeout_s)
        worker = ray.remote(num_gpus=1, num_cpus=1)(MegatronPolicyTrainer)
        self._actors = [
            worker.options(
                scheduling_strategy=on_bundle(rank // per_node),
                runtime_env={
                    "env_vars": distributed_env(rank, world_size, master_addr, master_port)
                },
            ).remote(config, temperature=temperature)
            for rank in range(world_size)
        ]
        # Construction (rendezvous, model load) runs in every actor at once; wait for all.
        ranks = ray.get([actor.ready.remote() for actor in self._actors], timeout=start_timeout_s)
        if ranks != list(range(world_size)):
            raise RuntimeError(f"trainer actors report ranks {ranks}, expected 0..{world_size - 1}")

    def _all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        calls = [getattr(actor, method).remote(*args, **kwargs) for actor in self._actors]
        return self._ray.get(calls, timeout=self._timeout)

    def train_step(
        self, trajectories: Sequence[Trajectory], advantages: torch.Tensor
    ) -> dict[str, float]:
        shared_trajectories = self._ray.put(list(trajectories))
        shared_advantages = self._ray.put(advantages)
        reports = self._all("train_step", shared_trajectories, shared_advantages)
        reporting = [report for report in reports if report]
        if not reporting:
            raise RuntimeError("no trainer rank reported metrics (no last pipeline stage?)")
        if reporting[0] == _NOTHING_TRAINED:
            return dict(_NOTHING_TRAINED)
        merged = reduce_loss_metrics(reporting)
        merged["num_sequences"] = sum(report["num_sequences"] for report in reporting)
        merged["grad_norm"] = reporting[0]["grad_norm"]  # global norm: the same on every rank
        merged["lr"] = reporting[0]["lr"]
        return merged

    def compute_logprobs(self, trajectories: Sequence[Trajectory]) -> list[list[float] | None]:
        """Per trajectory (None for masked ones)."""
        found: dict[int, list[float]] = {}
        for part in self._all("compute_logprobs", self._ray.put(list(trajectories))):
            found |= part
        return [found.get(index) for index in range(len(trajectories))]

    def export_weights(self) -> Mapping[str, torch.Tensor]:
        return self._all("export_weights")[0]

    def export_hf_checkpoint(self, directory: str | os.PathLike[str]) -> str:
        return self._all("export_hf_checkpoint", str(directory))[0]

    def save_checkpoint(self, directory: Path, step: int, data_state: Mapping[str, Any]) -> Path:
        return Path(self._all("save_checkpoint", str(directory), step, dict(data_state))[0])

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        return self._all("load_checkpoint", str(path))[0]

    def shutdown(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for actor in self._actors:
            self._ray.kill(actor)
        remove_placement_group(self._group)

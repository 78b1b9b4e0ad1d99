"""The torch policy trainer: GRPO steps on a Hugging Face causal LM, on the CPU or one GPU.

One optimizer step per call. The step's sequences are split into micro-batches of similar length
(sorted, so little compute goes to padding); each micro-batch's loss is normalised by the token
(or sequence) count of the whole step (`gymrl.trainer.grpo_step`), so the summed gradients equal
the full-batch gradient. The trainer runs where its model is: the caller moves the model to a GPU
(`gymrl.roles.actors.PolicyTrainerActor` does when the placement gives it one) and batches follow.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from gymrl.algo.loss import masked_token_logprobs
from gymrl.algo.trajectory import Trajectory, collate
from gymrl.config.schema import LossConfig, TorchTrainerConfig
from gymrl.model.precision import ComputeDtype, body_autocast, resolve_compute_dtype
from gymrl.run.checkpoint import TrainerState, capture_rng_state, load_checkpoint, save_checkpoint
from gymrl.trainer.grpo_step import loss_normalizer, micro_batch_loss, reduce_loss_metrics


class TorchPolicyTrainer:
    def __init__(
        self,
        model: PreTrainedModel,
        config: TorchTrainerConfig,
        loss: LossConfig,
        *,
        temperature: float,
        pad_token_id: int,
        keep_last_checkpoints: int,
        compute_dtype: ComputeDtype,
    ):
        """`compute_dtype` is `policy.compute_dtype` (`gymrl.model.precision`); resolved for the
        device the model is on when the trainer is built."""
        self.model = model
        self._config = config
        self._loss = loss
        self._temperature = temperature
        self._pad_token_id = pad_token_id
        self._keep_last = keep_last_checkpoints
        self._device = next(model.parameters()).device
        self._compute_dtype = resolve_compute_dtype(compute_dtype, self._device)
        optimizer = config.optimizer
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=optimizer.lr,
            betas=optimizer.betas,
            eps=optimizer.eps,
            weight_decay=optimizer.weight_decay,
        )
        # The KL anchor is the policy as it was before training; only kept when it is used.
        self._reference = (
            copy.deepcopy(model).eval().requires_grad_(False) if loss.kl_coef else None
        )
        self.weight_version = 0

    def train_step(
        self, trajectories: Sequence[Trajectory], advantages: torch.Tensor
    ) -> dict[str, float]:
        trainable = [
            i for i, t in enumerate(trajectories) if not t.is_masked and t.num_generated_tokens
        ]
        if not trainable:
            raise ValueError("train_step got no trajectory with generated tokens to train on")
        order = sorted(trainable, key=lambda i: len(trajectories[i].token_ids))
        normalizer = loss_normalizer(trajectories, self._loss.token_level_normalization)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        reports = []
        size = self._config.micro_batch_size
        for start in range(0, len(order), size):
            chunk = order[start : start + size]
            batch = collate(
                [trajectories[i] for i in chunk],
                advantages=advantages[chunk],
                pad_token_id=self._pad_token_id,
            )
            agents = [trajectories[i].agent for i in chunk]
            loss, metrics = self._micro_batch_loss(batch, normalizer, agents)
            loss.backward()
            reports.append(metrics)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self._config.optimizer.max_grad_norm
        )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.weight_version += 1
        return {
            **reduce_loss_metrics(reports),
            "grad_norm": float(grad_norm),
            "lr": self.optimizer.param_groups[0]["lr"],
            "num_sequences": float(len(trainable)),
        }

    def _micro_batch_loss(
        self, batch: dict[str, torch.Tensor], normalizer: float, agents: list[str]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        batch = {name: tensor.to(self._device, non_blocking=True) for name, tensor in batch.items()}
        logprobs = self._logprobs(self.model, batch)
        reference = None
        if self._reference is not None:
            with torch.no_grad():
                reference = self._logprobs(self._reference, batch)
        return micro_batch_loss(
            logprobs,
            batch,
            self._loss,
            normalizer=normalizer,
            agents=agents,
            reference_logprobs=reference,
        )

    def _logprobs(self, model: PreTrainedModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Log-probabilities of the generated tokens; the vocabulary projection runs only there."""
        output_layer = model.get_output_embeddings()
        if output_layer is None:
            raise ValueError(
                f"{type(model).__name__} has no output layer (lm_head); the torch trainer trains "
                "causal language models"
            )
        with body_autocast(self._device, self._compute_dtype):
            hidden = model.base_model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            ).last_hidden_state
        return masked_token_logprobs(
            hidden.to(model.dtype),
            output_layer,
            batch["input_ids"],
            batch["loss_mask"],
            self._temperature,
        )

    @property
    def compute_dtype(self) -> str:
        """What the body multiplies in, resolved for this device: `float32` or `bfloat16`
        (the parity gate's tolerance depends on it)."""
        return "bfloat16" if self._compute_dtype == torch.bfloat16 else "float32"

    def export_weights(
        self, dtypes: Mapping[str, torch.dtype] | None = None
    ) -> Mapping[str, torch.Tensor]:
        """The weights on the CPU (what crosses Ray's object store to the engine), each in
        `dtypes[name]` when given: the engine's own (`TorchGenerationEngine.weight_dtypes`), so a
        body rounded to bfloat16 crosses at half the bytes."""
        dtypes = dtypes or {}
        return {
            name: tensor.detach().to("cpu", dtype=dtypes.get(name, tensor.dtype), copy=True)
            for name, tensor in self.model.state_dict().items()
        }

    def save_checkpoint(self, directory: Path, step: int, data_state: Mapping[str, Any]) -> Path:
        state = TrainerState(
            step=step,
            weight_version=self.weight_version,
            data_state=dict(data_state),
            rng=[capture_rng_state()],
        )
        return save_checkpoint(
            directory, self.model, self.optimizer, state, keep_last=self._keep_last
        )

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        state = load_checkpoint(path, self.model, self.optimizer)
        self.weight_version = state.weight_version
        return state.resume_info()

"""The torch policy trainer: GRPO steps on a Hugging Face causal LM, on the CPU or one GPU.

One optimizer step per call. The step's sequences are split into micro-batches of similar length
(sorted, so little compute goes to padding); each micro-batch's loss is normalised by the token
(or sequence) count of the whole step, so the summed gradients equal the full-batch gradient.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from gymrl.algo.loss import grpo_loss, masked_token_logprobs
from gymrl.algo.trajectory import Trajectory, collate
from gymrl.checkpoint import load_checkpoint, save_checkpoint
from gymrl.config.schema import LossConfig, TorchTrainerConfig


class TorchPolicyTrainer:
    def __init__(
        self,
        model: torch.nn.Module,
        config: TorchTrainerConfig,
        loss: LossConfig,
        *,
        temperature: float,
        pad_token_id: int,
        keep_last_checkpoints: int,
    ):
        self.model = model
        self._config = config
        self._loss = loss
        self._temperature = temperature
        self._pad_token_id = pad_token_id
        self._keep_last = keep_last_checkpoints
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
        normalizer = self._normalizer([trajectories[i] for i in order])
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {}
        size = self._config.micro_batch_size
        for start in range(0, len(order), size):
            chunk = order[start : start + size]
            batch = collate(
                [trajectories[i] for i in chunk],
                advantages=advantages[chunk],
                pad_token_id=self._pad_token_id,
            )
            loss, metrics = self._micro_batch_loss(batch, normalizer)
            loss.backward()
            _accumulate(totals, metrics)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self._config.optimizer.max_grad_norm
        )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.weight_version += 1
        return {
            **_finalise(totals),
            "grad_norm": float(grad_norm),
            "lr": self.optimizer.param_groups[0]["lr"],
            "num_sequences": float(len(trainable)),
        }

    def _micro_batch_loss(
        self, batch: dict[str, torch.Tensor], normalizer: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        logprobs = self._logprobs(self.model, batch)
        reference = None
        if self._reference is not None:
            with torch.no_grad():
                reference = self._logprobs(self._reference, batch)
        loss_config = self._loss
        return grpo_loss(
            logprobs,
            batch["generation_logprobs"],
            batch["advantages"],
            batch["loss_mask"],
            reference_logprobs=reference,
            clip_ratio_low=loss_config.clip_ratio_low,
            clip_ratio_high=loss_config.clip_ratio_high,
            kl_coef=loss_config.kl_coef,
            importance_sampling_correction=loss_config.importance_sampling_correction,
            importance_ratio_cap=loss_config.importance_ratio_cap,
            token_level_normalization=loss_config.token_level_normalization,
            normalizer=normalizer,
        )

    def _logprobs(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Log-probabilities of the generated tokens; the vocabulary projection runs only there."""
        hidden = model.base_model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).last_hidden_state
        return masked_token_logprobs(
            hidden,
            model.get_output_embeddings(),
            batch["input_ids"],
            batch["loss_mask"],
            self._temperature,
        )

    def _normalizer(self, trajectories: Sequence[Trajectory]) -> float:
        if self._loss.token_level_normalization:
            return float(sum(t.num_generated_tokens for t in trajectories))
        return float(len(trajectories))

    def export_weights(self) -> Mapping[str, torch.Tensor]:
        return {name: tensor.detach().clone() for name, tensor in self.model.state_dict().items()}

    def save_checkpoint(self, directory: Path, step: int, data_state: Mapping[str, Any]) -> Path:
        return save_checkpoint(
            directory,
            step,
            self.model,
            self.optimizer,
            data_state=data_state,
            extra={},
            weight_version=self.weight_version,
            keep_last=self._keep_last,
        )

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        state = load_checkpoint(path, self.model, self.optimizer)
        self.weight_version = state["weight_version"]
        return state


# Metrics that add up over micro-batches (the loss is already normalised by the step's total);
# the rest are averaged weighted by tokens, or take the maximum.
_SUMMED = ("loss", "pg_loss", "kl", "num_tokens")
_MAXED = ("importance_ratio/max",)


def _accumulate(totals: dict[str, float], metrics: Mapping[str, float]) -> None:
    tokens = metrics["num_tokens"]
    for key, value in metrics.items():
        if key in _SUMMED:
            totals[key] = totals.get(key, 0.0) + value
        elif key in _MAXED:
            totals[key] = max(totals.get(key, value), value)
        else:
            totals[key] = totals.get(key, 0.0) + value * tokens
    totals["_weight"] = totals.get("_weight", 0.0) + tokens


def _finalise(totals: dict[str, float]) -> dict[str, float]:
    weight = max(totals.pop("_weight"), 1.0)
    return {
        key: value if key in _SUMMED or key in _MAXED else value / weight
        for key, value in totals.items()
    }

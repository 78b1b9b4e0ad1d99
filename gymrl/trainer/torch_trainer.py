"""The torch policy trainer: GRPO steps on a Hugging Face causal LM, on the CPU or one GPU.

One optimizer step per call. The step's sequences are split into micro-batches; each
micro-batch's loss is normalised by the token (or sequence) count of the whole step
(`gymrl.trainer.grpo_step`), so the summed gradients equal the full-batch gradient. With
`trainer.prefix_packing` (the default) a micro-batch is a prefix tree of sequences that start
alike (`gymrl.trainer.prefix_packing`): a prompt shared by a step's episodes is computed once,
with the same log-probabilities and gradients as computing it for each. Without it, sequences of
similar length are right-padded side by side (sorted, so little compute goes to padding). The
trainer runs where its model is: the caller moves the model to a GPU
(`gymrl.roles.actors.PolicyTrainerActor` does when the placement gives it one) and batches follow.

With `trainer.lora` the model gets a PEFT LoRA adapter (`gymrl.run.adapter.attach_lora`) and
only the adapter trains: its parameters alone are in the optimizer and clipped, the frozen base
holds no gradients nor moments. The KL anchor is then the base itself, computed under PEFT's
`disable_adapter` rather than from a second copy of the model; the generation log-probabilities
(the old policy of the ratio) come from the engine, which serves the merged adapter. Checkpoints
hold the adapter in PEFT's format, and a refit moves the adapter alone (`export_adapter`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from gymrl.algo.loss import gathered_token_logprobs, masked_token_logprobs
from gymrl.algo.trajectory import Trajectory, collate
from gymrl.config.schema.loss import LossConfig
from gymrl.config.schema.trainer import TorchTrainerConfig
from gymrl.model.attention_mask import additive_mask
from gymrl.model.precision import ComputeDtype, body_autocast, resolve_compute_dtype
from gymrl.run.adapter import AdapterWeights, attach_lora
from gymrl.run.checkpoint import TrainerState, capture_rng_state, load_checkpoint, save_checkpoint
from gymrl.trainer.grpo_step import loss_normalizer, micro_batch_loss, reduce_loss_metrics
from gymrl.trainer.parity_gate import PASSED_METRIC, ParityCheck, ParityGateError
from gymrl.trainer.prefix_packing import PrefixTree, pack_prefix_tree, prefix_chunks

# The attention packing runs on: sdpa applies a custom 4D float mask as given (transformers passes
# it through untouched) and computes a chain (a long episode packed alone) as causal attention
# without an [N, N] matrix, which is what bounds packing's memory. Flash-attention kernels take
# padding masks only and would ignore the tree's; eager materialises the [N, N] scores of every
# head even for a chain, so the bound would not hold.
_PACKED_ATTENTION = "sdpa"


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
        attention = model.config._attn_implementation
        if config.prefix_packing and attention != _PACKED_ATTENTION:
            raise ValueError(
                f"trainer.prefix_packing=true needs {_PACKED_ATTENTION} attention, which applies "
                "the tree's 4D mask and computes a long episode without an N x N matrix; this "
                f"model's attn_implementation is {attention!r}. Load it with sdpa, or set "
                "trainer.prefix_packing=false"
            )
        # PEFT wraps the model in place; `model` stays the transformers model the trainer runs.
        self._peft = attach_lora(model, config.lora) if config.lora.enabled else None
        self.model = model
        # What a checkpoint saves and loads: the adapter alone, or the model.
        self._saved: torch.nn.Module = model if self._peft is None else self._peft
        self._config = config
        self._loss = loss
        self._temperature = temperature
        self._pad_token_id = pad_token_id
        self._keep_last = keep_last_checkpoints
        self._device = next(model.parameters()).device
        self._compute_dtype = resolve_compute_dtype(compute_dtype, self._device)
        optimizer = config.optimizer
        # Every parameter, or with LoRA the adapter's only (PEFT froze the rest).
        self._trained = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self._trained,
            lr=optimizer.lr,
            betas=optimizer.betas,
            eps=optimizer.eps,
            weight_decay=optimizer.weight_decay,
        )
        # The KL anchor is the policy as it was before training; only kept when it is used, and
        # with LoRA it is the base model (the adapter disabled), which needs no copy.
        self._reference = (
            copy.deepcopy(model).eval().requires_grad_(False)
            if loss.kl_coef and self._peft is None
            else None
        )
        self.weight_version = 0

    def train_step(
        self,
        trajectories: Sequence[Trajectory],
        advantages: torch.Tensor,
        parity: ParityCheck | None = None,
    ) -> dict[str, float]:
        """One optimizer step. `parity` (the run's first step) is applied after the backward
        passes and before the update (`gymrl.trainer.parity_gate`): a failed check that stops raises
        with the weights untouched; its verdict is the metric `parity/passed`."""
        trainable = [
            i for i, t in enumerate(trajectories) if not t.is_masked and t.num_generated_tokens
        ]
        if not trainable:
            raise ValueError("train_step got no trajectory with generated tokens to train on")
        normalizer = loss_normalizer(trajectories, self._loss.token_level_normalization)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        reports = []
        for chunk in self._micro_batches(trajectories, trainable):
            chosen = [trajectories[i] for i in chunk]
            batch = collate(chosen, advantages=advantages[chunk], pad_token_id=self._pad_token_id)
            tree = (
                pack_prefix_tree([t.token_ids for t in chosen])
                if self._config.prefix_packing
                else None
            )
            agents = [t.agent for t in chosen]
            loss, metrics = self._micro_batch_loss(batch, tree, normalizer, agents)
            loss.backward()
            reports.append(metrics)
        step_metrics = reduce_loss_metrics(reports)
        checked = {}
        if parity is not None:
            try:
                checked[PASSED_METRIC] = float(parity(step_metrics))
            except ParityGateError:
                self.optimizer.zero_grad(set_to_none=True)  # this batch is never trained on
                raise
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self._trained, self._config.optimizer.max_grad_norm
        )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.weight_version += 1
        return {
            **step_metrics,
            **checked,
            "grad_norm": float(grad_norm),
            "lr": self.optimizer.param_groups[0]["lr"],
            "num_sequences": float(len(trainable)),
        }

    def _micro_batches(
        self, trajectories: Sequence[Trajectory], trainable: list[int]
    ) -> list[list[int]]:
        """The step's trainable trajectories (indices) in micro-batches: with prefix packing,
        sequences that share a prefix side by side and at most `max_packed_tokens` tree nodes per
        micro-batch; otherwise `micro_batch_size` sequences of similar length."""
        if self._config.prefix_packing:
            chunks = prefix_chunks(
                [trajectories[i].token_ids for i in trainable], self._config.max_packed_tokens
            )
            return [[trainable[j] for j in chunk] for chunk in chunks]
        order = sorted(trainable, key=lambda i: len(trajectories[i].token_ids))
        size = self._config.micro_batch_size
        return [order[start : start + size] for start in range(0, len(order), size)]

    def _micro_batch_loss(
        self,
        batch: dict[str, torch.Tensor],
        tree: PrefixTree | None,
        normalizer: float,
        agents: list[str],
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """`tree`: the batch's sequences packed as a prefix tree, or None to run them padded."""
        batch = {name: tensor.to(self._device, non_blocking=True) for name, tensor in batch.items()}
        tree = tree.to(self._device) if tree is not None else None
        logprobs = self._logprobs(self.model, batch, tree)
        reference = None
        if self._loss.kl_coef:
            base = self._peft.disable_adapter() if self._peft is not None else nullcontext()
            with torch.no_grad(), base:
                anchor = self.model if self._reference is None else self._reference
                reference = self._logprobs(anchor, batch, tree)
        return micro_batch_loss(
            logprobs,
            batch,
            self._loss,
            normalizer=normalizer,
            agents=agents,
            reference_logprobs=reference,
        )

    def _logprobs(
        self, model: PreTrainedModel, batch: dict[str, torch.Tensor], tree: PrefixTree | None
    ) -> torch.Tensor:
        """Log-probabilities of the generated tokens, `[B, T]` like `batch`; the vocabulary
        projection runs only there. With `tree`, the body runs once over its nodes, each
        attending to its ancestors at its depth, and every token reads its node's hidden state."""
        output_layer = model.get_output_embeddings()
        if output_layer is None:
            raise ValueError(
                f"{type(model).__name__} has no output layer (lm_head); the torch trainer trains "
                "causal language models"
            )
        if tree is None:
            hidden = self._hidden(
                model, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            )
            return masked_token_logprobs(
                hidden, output_layer, batch["input_ids"], batch["loss_mask"], self._temperature
            )
        # A chain (a sequence packed alone: every long episode) is causal attention, which the
        # attention kernels compute without an [N, N] mask; a branching tree has at most
        # max_packed_tokens nodes. The mask is in the dtype attention computes in, so autocast
        # has nothing to convert and the layers share one copy of it.
        mask = (
            None
            if tree.is_chain()
            else additive_mask(tree.visible()[None, None], self._compute_dtype or model.dtype)
        )
        hidden = self._hidden(
            model,
            input_ids=tree.token_ids[None],
            attention_mask=mask,
            position_ids=tree.positions[None],
        )[0]
        return gathered_token_logprobs(
            hidden,
            tree.token_index,
            output_layer,
            batch["input_ids"],
            batch["loss_mask"],
            self._temperature,
        )

    def _hidden(self, model: PreTrainedModel, **inputs: torch.Tensor | None) -> torch.Tensor:
        """The body's last hidden states under this trainer's autocast, in the weights' dtype
        (the output layer and the log-softmax run outside autocast)."""
        with body_autocast(self._device, self._compute_dtype):
            hidden = model.base_model(**inputs).last_hidden_state
        return hidden.to(model.dtype)

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
        if self._peft is not None:
            raise TypeError(
                "a LoRA trainer refits the adapter alone (export_adapter); its state dict holds "
                "PEFT's layers, not the model's weights"
            )
        dtypes = dtypes or {}
        return {
            name: tensor.detach().to("cpu", dtype=dtypes.get(name, tensor.dtype), copy=True)
            for name, tensor in self.model.state_dict().items()
        }

    def export_adapter(self) -> AdapterWeights:
        """The LoRA adapter as PEFT saves it, on the CPU: what an adapter refit moves."""
        if self._peft is None:
            raise TypeError("export_adapter needs trainer.lora.enabled=true")
        return AdapterWeights.of(self._peft)

    def save_checkpoint(self, directory: Path, step: int, data_state: Mapping[str, Any]) -> Path:
        state = TrainerState(
            step=step,
            weight_version=self.weight_version,
            data_state=dict(data_state),
            rng=[capture_rng_state()],
        )
        return save_checkpoint(
            directory, self._saved, self.optimizer, state, keep_last=self._keep_last
        )

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        state = load_checkpoint(path, self._saved, self.optimizer)
        self.weight_version = state.weight_version
        return state.resume_info()

"""`trainer.*` (conf/trainer/): each trainer backend (torch, Megatron), its batching and
parallelism, its optimizer (`trainer.optimizer.*`) and its LoRA adapter (`trainer.lora.*`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from gymrl.config.schema.base import Strict

LearningRate = Annotated[float, Field(gt=0, description="AdamW learning rate.")]
TrainerStartTimeout = Annotated[
    float,
    Field(
        gt=0,
        description="Deadline for the trainer's actors to start: placed, model loaded, process "
        "group joined. Shown by the dry-run plan.",
    ),
]
WeightDecay = Annotated[float, Field(ge=0, description="AdamW weight decay.")]


class OptimizerConfig(Strict):
    """AdamW. Each trainer's subclass sets the learning rate and weight decay defaults that suit
    the models it trains."""

    lr: LearningRate
    weight_decay: WeightDecay
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW betas.")
    eps: float = Field(default=1e-8, gt=0, description="AdamW epsilon.")
    max_grad_norm: float = Field(default=1.0, gt=0, description="Gradient clipping norm.")


class TorchOptimizerConfig(OptimizerConfig):
    """Small models for a few steps: a larger step, no decay."""

    lr: LearningRate = 1e-5
    weight_decay: WeightDecay = 0.0


class MegatronOptimizerConfig(OptimizerConfig):
    """Billion-parameter models over hundreds of steps: the usual RL fine-tuning step and decay."""

    lr: LearningRate = 1e-6
    weight_decay: WeightDecay = 0.01


# Every Linear of a Llama-family decoder layer (Llama, Mistral, Qwen2/3 name them alike): attention
# and MLP. "LoRA Without Regret" (Thinking Machines, 2025) found attention-only adapters
# underperform in RL and the MLP essential; all of them is what it recommends.
_DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(Strict):
    """A low-rank adapter trained instead of the whole model: the base weights stay frozen (no
    gradients, no optimizer moments, no float32 master copy of them), and a refit moves the
    adapter's megabytes instead of every weight. Checkpoints hold the adapter in PEFT's format.
    How to choose the rank and the learning rate: docs/configuration.md, "LoRA"."""

    enabled: bool = Field(
        default=False,
        description="Train a LoRA adapter on the frozen policy instead of every weight.",
    )
    rank: int = Field(
        default=16,
        gt=0,
        description="The adapter's rank r: each targeted weight W (out x in) learns B @ A with "
        "A r x in and B out x r. RL carries little information per episode; rank 1 matched "
        "full training on math in 'LoRA Without Regret'. At most the smallest side of a "
        "targeted weight (checked at composition time).",
    )
    alpha: int = Field(
        default=32,
        gt=0,
        description="LoRA's alpha: the update is scaled by alpha / rank (PEFT's lora_alpha).",
    )
    dropout: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="Dropout on the adapter's input during training (PEFT's lora_dropout).",
    )
    target_modules: tuple[str, ...] = Field(
        default=_DECODER_LINEARS,
        min_length=1,
        description="Names of the Linear modules of the decoder layers that get an adapter "
        "(PEFT's target_modules: a module matches when its name ends with one of these). "
        "Default: every Linear of a Llama-family layer, attention and MLP. Checked at "
        "composition time against the model's own modules.",
    )


class TorchTrainerConfig(Strict):
    backend: Literal["torch"] = "torch"
    micro_batch_size: int = Field(
        default=4,
        gt=0,
        description="Sequences per forward/backward when prefix_packing is off (with it on, "
        "max_packed_tokens sizes micro-batches).",
    )
    prefix_packing: bool = Field(
        default=True,
        description="Pack each micro-batch's sequences as a prefix tree: a prefix shared by "
        "several sequences (a system prompt, a group's question) is computed once, each token "
        "attending to its ancestors through a 4D mask; same log-probabilities and gradients as "
        "padding them side by side, to float rounding. Off: right-padded micro-batches of "
        "micro_batch_size sequences. Needs sdpa attention (how models load here; eager would "
        "hold every head's N x N scores of a long episode). "
        "Torch trainer only (the Megatron trainer batches its own way).",
    )
    max_packed_tokens: int = Field(
        default=1024,
        gt=0,
        description="With prefix_packing, the most tree nodes (distinct prefix tokens) one "
        "forward/backward packs: sequences are sorted so that those sharing a prefix are "
        "packed together, then cut into micro-batches at this budget (a longer sequence is "
        "packed alone). A token budget rather than a sequence count because memory grows with "
        "the packed tokens, not with the sequences sharing them. Attention over the tree is "
        "dense (an N x N mask), so a larger tree costs quadratically: on the embedded "
        "calculator step (16 episodes, one 1,984-node tree) 1024 was the fastest and used the "
        "least memory (benchmarks/README.md, 'Prefix packing').",
    )
    # One process loading a model that fits one device.
    start_timeout_s: TrainerStartTimeout = 300.0
    optimizer: TorchOptimizerConfig = Field(default_factory=TorchOptimizerConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)


class MegatronTrainerConfig(Strict):
    backend: Literal["megatron"] = "megatron"
    tensor_model_parallel_size: int = Field(default=1, gt=0, description="TP degree.")
    pipeline_model_parallel_size: int = Field(default=1, gt=0, description="PP degree.")
    context_parallel_size: int = Field(default=1, gt=0, description="CP degree (long contexts).")
    expert_model_parallel_size: int = Field(default=1, gt=0, description="EP degree (MoE).")
    expert_tensor_parallel_size: int = Field(
        default=1, gt=0, description="TP degree inside each expert (MoE)."
    )
    sequence_parallel: bool = Field(default=False, description="Megatron sequence parallelism.")
    micro_batch_size: int = Field(default=1, gt=0, description="Sequences per micro-batch.")
    activation_checkpointing: bool = Field(default=True, description="Recompute activations.")
    transformer_impl: Literal["transformer_engine", "local"] = Field(
        default="transformer_engine",
        description="Layer implementation: Transformer Engine (fused kernels, needed for context "
        "parallelism) or Megatron's local PyTorch layers (for machines without TE).",
    )
    # A 30B MoE on 64 ranks: rendezvous, Hugging Face-to-Megatron conversion of every rank's
    # shard from a shared filesystem, distributed optimizer allocation.
    start_timeout_s: TrainerStartTimeout = 1800.0
    optimizer: MegatronOptimizerConfig = Field(default_factory=MegatronOptimizerConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)

    @property
    def model_parallel_size(self) -> int:
        return (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
        )


TrainerConfig = Annotated[
    TorchTrainerConfig | MegatronTrainerConfig, Field(discriminator="backend")
]

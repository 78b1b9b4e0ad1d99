"""`generation.*` (conf/generation/): each generation backend (torch, SGLang), the policy model
server in front of it (`generation.server.*`), sampling, how SGLang servers are launched
(`generation.launch.*`) and how new weights reach them (`generation.refit.*`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from gymrl.config.schema.base import Strict
from nemo_gym_ext.wire import MAX_TEMPERATURE

MaxTokensPerTurn = Annotated[int, Field(gt=0, description="Default max_tokens of one model call.")]


class ModelServerConfig(Strict):
    """The policy model server in front of an engine. Each engine's subclass sets the defaults
    that depend on the engine's speed and scheduling."""

    honor_prompt_token_ids: bool = Field(
        default=True,
        description="Keep the exact token ids clients send back on earlier assistant messages and "
        "render only new messages (the on-policy prefix fix). false re-tokenises the whole "
        "conversation from text. A request's required_prefix_token_ids (Gym's exact-prefix "
        "contract) is honoured either way: the client checks its prompt against it.",
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
    request_bytes_per_context_token: int = Field(
        default=1024,
        gt=0,
        description="Bytes of request body allowed per token of the context: the largest body "
        "is policy.max_total_sequence_length x this (2 MiB at 2048 tokens, 64 MiB at 65,536), "
        "refused with 413 by its Content-Length before it is read (chunked: when the bytes read "
        "pass it). Rule: a token costs ~4-8 bytes as text, ~22 as a sent-back log-probability, "
        "and 6.8 as an id in every later assistant turn's prompt_token_ids, so an episode that "
        "fills the context posts ~30 + 3.4 x (its model calls) bytes per token; 1024 admits "
        "~290 calls (a 200-call SWE episode: 677). Clients that send no ids back need ~16.",
    )
    render_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="Deadline of each call on the policy server's one render worker (rendering "
        "a request's prompt, parsing its answer), waiting included: past it the request is 504 "
        "(it was running) or 503 with Retry-After (it was waiting), and while a render overruns "
        "new requests are 503 at once. A full context renders in well under a second.",
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
        "text of a forgotten one (gymrl/generation/server/divergence_watch.py), so a small "
        "memory misses divergences and never invents one.",
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
        "prefills only the rest (gymrl/generation/torch/prefix_cache.py); least recently used "
        "beyond this, all dropped at a refit; 0 = off. Memory: layers x kv_heads x head_dim x "
        "(bytes of a key + of a value) per token, in the compute dtype (SmolLM2-135M: 46 KB in "
        "float32, so 16384 tokens are about 750 MB; 23 KB and 380 MB in bfloat16).",
    )
    decode_path: Literal["auto", "fused", "transformers"] = Field(
        default="auto",
        description="How the torch engine decodes: fused runs its own decode step for Llama "
        "models (gymrl/generation/torch/llama_decode.py: fused projections, weights packed once "
        "for the CPU's matrix library, attention over the cache without copies; the same "
        "computation, a decode step 1.4-1.9x faster on SmolLM2, benchmarks/README.md, "
        "'Generation speed'), and refuses another model; "
        "transformers calls the model's forward at every step; auto is fused where the model "
        "allows it, else transformers (logged). Prefill always runs the model's forward.",
    )
    device: Literal["auto", "cpu"] = Field(
        default="auto",
        description="Where the torch engine runs: auto on one of the cluster's GPUs when it has "
        "any, else the CPU; cpu on the CPU whatever the cluster has, every GPU left to the "
        "trainer (the Megatron trainer on this CPU, whose ranks' GPUs its CPU stand-in maps to "
        "the CPU: +experiment=megatron_lora_cpu).",
    )
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    server: TorchModelServerConfig = Field(default_factory=TorchModelServerConfig)


class RefitConfig(Strict):
    """How new weights reach the SGLang servers (`gymrl.generation.sglang.weight_sync`)."""

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
        "measured alike (benchmarks/README.md, 'Refit').",
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
    """How each SGLang server is started (`gymrl.generation.sglang.servers.server_command`): the
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
        "from the starting process (torch's default: every core). At tensor_parallel_size > 1 "
        "each rank is also bound to a block of this many cores, rank r to the r-th "
        "(SGLANG_CPU_OMP_THREADS_BIND; null leaves SGLang's binding of one NUMA node per rank, "
        "which refuses more ranks than nodes).",
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
        description="Extra environment variables of each server process, set last (e.g. a "
        "PYTHONPATH holding a CPU build of sgl_kernel, or another SGLANG_CPU_OMP_THREADS_BIND).",
    )
    deterministic_inference: bool = Field(
        default=False,
        description="SGLang's --enable-deterministic-inference: batch-invariant kernels, and "
        "the only mode in which SGLang honours a request's sampling seed. Off, a chat request "
        "that sends `seed` is refused by the engine (SGLang would ignore it silently). Costs "
        "decode speed on GPUs. SGLang 0.5.23 has it for the attention backends ascend, fa3, "
        "fa4, flashinfer, intel_xpu and triton only (not torch_native, so not on a CPU).",
    )

    lora_backend: Literal["csgmv", "triton", "triton_v2", "torch_native"] = Field(
        default="csgmv",
        description="SGLang's --lora-backend, the kernels that apply a LoRA adapter unmerged, "
        "used when the run trains one (trainer.lora.enabled; the other LoRA flags follow from "
        "trainer.lora and grpo, gymrl.generation.sglang.adapters). csgmv (SGLang's default) "
        "and the triton ones need a GPU; torch_native is plain torch and what runs on a CPU "
        "(generation=sglang_cpu sets it).",
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

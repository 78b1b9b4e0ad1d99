"""The generation role: an engine (torch, or a group of SGLang servers) behind the
OpenAI-compatible policy model server, the URL Gym agents call; refit to a weight version.

`start_generation_server` is how every caller gets one (the GRPO recipe, `serve`, benchmarks).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from pydantic import SecretStr
from transformers import PreTrainedTokenizerBase

from gymrl.algo.trajectory import Trajectory
from gymrl.cluster.placement import Placement, actor_options
from gymrl.cluster.ray_calls import close_actor, wait_for
from gymrl.cluster.session import OnCleanup
from gymrl.config.schema.generation import SGLangGenerationConfig, TorchGenerationConfig
from gymrl.config.schema.recipe import RecipeConfig
from gymrl.generation.server.announce import policy_server_host
from gymrl.generation.server.app import create_policy_server_app
from gymrl.generation.server.chat_template import ChatFormat
from gymrl.generation.server.divergence_watch import DivergenceCounts, DivergenceWatch
from gymrl.generation.server.route_store import RouteStore, RouteStoreCounts
from gymrl.generation.server.sampling_rules import SamplingCounts, SamplingParity, SamplingRules
from gymrl.generation.sglang.adapters import AdapterServing
from gymrl.generation.sglang.engine import SGLangEngine
from gymrl.generation.sglang.servers import SGLangServerGroup
from gymrl.generation.torch.engine import EngineCounters, EngineStep, TorchGenerationEngine
from gymrl.generation.types import EngineFailedError, RouteLayout
from gymrl.model.loading import load_tokenizer
from gymrl.model.policy import build_policy, model_folder
from gymrl.model.tokens import eos_token_id, policy_end_token_ids
from gymrl.run.adapter import AdapterWeights
from nemo_gym_ext.gym_launch import PolicyEndpoint
from nemo_gym_ext.http_server import serve_in_thread

GENERATION_CLOSE_S = 60.0  # the server lets a running engine batch finish first
ENGINE_FAILURE_CHECK_S = 30.0  # an answer from the actor's thread pool, no engine work
ROUTE_ASSEMBLY_S = 60.0  # copies of held arrays, no engine work


@ray.remote(num_cpus=0)
class GenerationServer:
    """The policy model server in front of the configured engine (torch, or SGLang servers)."""

    def __init__(
        self,
        config: RecipeConfig,
        *,
        output_dir: str,
        torch_threads: int,
        placement: Placement,
        placement_group: Any,
        api_key: SecretStr,
        sampling_rules: SamplingRules | None,
        episode_deadline_s: float | None,
    ):
        """`placement` says where the engines run (the torch engine: on this actor's GPU, if it
        has one); SGLang servers go into bundles of `placement_group`. `episode_deadline_s`: how
        long any client's episode may last (the divergence watch's marks last as long), None
        when the clients are not the run's. `api_key` is the run's
        (`gymrl.generation.server.api_key`); `sampling_rules` a training run's (else requests are
        sampled as they ask)."""
        torch.set_num_threads(torch_threads)
        policy, generation = config.policy, config.generation
        # What this actor starts, closed in reverse by close(); if the constructor fails
        # half-way, the SGLang servers it started are shut down before the error leaves.
        with ExitStack() as started:
            folder = model_folder(policy)
            end_ids = policy_end_token_ids(folder, policy.end_token_ids)
            if isinstance(generation, SGLangGenerationConfig):
                backend = build_sglang_backend(
                    config,
                    folder=folder,
                    end_ids=end_ids,
                    output_dir=Path(output_dir),
                    placement=placement,
                    placement_group=placement_group,
                    started=started,
                )
                self._tp_size = generation.tensor_parallel_size
            else:
                backend = build_torch_backend(
                    config, end_ids=end_ids, placement=placement, started=started
                )
            self._backend = backend
            tokenizer = backend.tokenizer
            server = generation.server
            self._sampling_parity = sampling_rules and SamplingParity(sampling_rules)
            self._route_store = route_store_for(config, folder)
            self._divergence_watch = DivergenceWatch(
                capacity=server.divergence_memory,
                stop=server.stop_on_divergence,
                marks_last_s=episode_deadline_s,
            )
            app = create_policy_server_app(
                backend.engine,
                ChatFormat.from_policy(policy, tokenizer, model_end_ids=end_ids),
                model_name=policy.name,
                api_key=api_key,
                honor_prompt_token_ids=server.honor_prompt_token_ids,
                default_max_tokens=server.max_tokens_per_turn,
                max_context_tokens=policy.max_total_sequence_length,
                request_timeout_s=server.request_timeout_s,
                request_bytes_per_context_token=server.request_bytes_per_context_token,
                render_timeout_s=server.render_timeout_s,
                sampling_parity=self._sampling_parity,
                divergence_watch=self._divergence_watch,
                route_store=self._route_store,
            )
            http_server = serve_in_thread(
                app,
                host=policy_server_host(config),
                port=server.port,
                max_body_bytes=None,  # the app bounds bodies by its context, before reading
                max_concurrency=server.max_concurrent_requests,
            )
            # Requests in progress finish first; the engines close after the server.
            started.callback(http_server.close, timeout_s=50.0)
            self._public_url = http_server.url.replace("0.0.0.0", ray.util.get_node_ip_address())
            self._started = started.pop_all()

    def base_url(self) -> str:
        """The OpenAI base URL agents use (`.../v1`)."""
        return f"{self._public_url}/v1"

    def engine_counters(self) -> EngineCounters | None:
        """The torch engine's totals (`EngineCounters`); SGLang's live on its servers."""
        local = self._backend.local
        return None if local is None else local.counters()

    def engine_failure(self) -> EngineFailedError | None:
        """Why the engine stopped for good (`EngineFailedError`), or None while it serves."""
        return self._backend.engine.failure()

    def sampling_counts(self) -> SamplingCounts | None:
        """Requests overridden or refused for their sampling (None: the server has no parity)."""
        return None if self._sampling_parity is None else self._sampling_parity.counts()

    def set_validating(self, validating: bool) -> None:
        """Open or close the window in which requests may ask for validation's sampling
        (`SamplingParity.set_validating`); without parity, a no-op."""
        if self._sampling_parity is not None:
            self._sampling_parity.set_validating(validating)
        if self._route_store is not None:  # validation's episodes are never trained on
            self._route_store.set_capturing(not validating)

    def assemble_routes(
        self, episodes: Sequence[tuple[Sequence[int], Sequence[int]]]
    ) -> list[np.ndarray]:
        """Router replay: the routes of each `(token_ids, call_ends)` episode, from the calls
        the policy server held (`RouteStore.assemble`)."""
        store = self._require_routes()
        return [store.assemble(token_ids, call_ends) for token_ids, call_ends in episodes]

    def route_counts(self) -> RouteStoreCounts:
        """The route store's totals (router replay)."""
        return self._require_routes().counts()

    def _require_routes(self) -> RouteStore:
        if self._route_store is None:  # the validator refuses such configs
            raise TypeError("routes are held only with policy.router_replay.enabled=true")
        return self._route_store

    def divergence_counts(self) -> DivergenceCounts:
        """Requests whose prompt did not extend this server's earlier answer, and those of them
        answered without generating (`generation.server.stop_on_divergence`)."""
        return self._divergence_watch.counts()

    def record_engine_timeline(self) -> None:
        """Start recording the torch engine's loop iterations (SGLang's: none)."""
        if self._backend.local is not None:
            self._backend.local.record_timeline()

    def engine_timeline(self) -> list[EngineStep] | None:
        """The iterations recorded since `record_engine_timeline`; None for SGLang engines."""
        local = self._backend.local
        return None if local is None else local.timeline()

    def weight_dtypes(self) -> dict[str, torch.dtype] | None:
        """The torch engine's stored dtype per weight, for `refit_through_object_store`; None for
        SGLang engines, which load a refit in their own dtype."""
        local = self._backend.local
        return None if local is None else local.weight_dtypes()

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> int:
        engine = self._backend.engine
        engine.update_weights(state_dict, version)
        return engine.weight_version

    def update_adapter(self, adapter: AdapterWeights, version: int) -> int:
        """A LoRA run's refit: the torch engine merges the adapter into its base weights, the
        SGLang servers load it under a versioned name (`SGLangEngine.update_adapter`)."""
        engine = self._backend.engine
        engine.update_adapter(adapter, version)
        return engine.weight_version

    def weight_sync_targets(self) -> tuple[list[str], list[int]]:
        """The SGLang servers' URLs and TP sizes, for the trainer's `WeightSender`."""
        engine = self._servers("weight sync by broadcast")
        return engine.server_urls, [self._tp_size] * len(engine.server_urls)

    def begin_refit(self, version: int) -> None:
        """Pause the SGLang servers while the trainer broadcasts weight `version` to them."""
        self._servers("weight sync by broadcast").begin_refit(version)

    def end_refit(self, version: int) -> int:
        self._servers("weight sync by broadcast").end_refit(version)
        return version

    def refit_from_disk(self, path: str, version: int) -> int:
        """SGLang engines load a Hugging Face checkpoint the trainer exported to shared disk."""
        engine = self._servers("refit from disk")
        engine.refit_from_disk(path, version)
        return engine.weight_version

    def _servers(self, verb: str) -> SGLangEngine:
        if self._backend.servers is None:  # the validator refuses such configs
            raise TypeError(f"{verb} is the SGLang engines' refit path (generation=sglang)")
        return self._backend.servers

    def close(self) -> None:
        """Stop the HTTP server, then the SGLang engines behind it (each even if one fails)."""
        self._started.close()


def route_layout(folder: str) -> RouteLayout:
    """The routes of the MoE model in `folder` (its `config.json`)."""
    return RouteLayout.of_model_config(json.loads((Path(folder) / "config.json").read_text()))


def route_store_for(config: RecipeConfig, folder: str) -> RouteStore | None:
    """Router replay's store of routes per model call; None without router replay."""
    replay = config.policy.router_replay
    if not replay.enabled:
        return None
    return RouteStore(route_layout(folder), max_bytes=replay.max_held_mib << 20)


@dataclass(frozen=True)
class EngineBackend:
    """What a backend builder hands the generation server: the engine (it schedules each
    request itself), the tokenizer the chat format renders with, and the verbs only one kind of
    engine has: `local`, an in-process torch engine (counters, timeline, weight dtypes), or
    `servers`, the client of SGLang servers (refit by broadcast or from disk)."""

    engine: TorchGenerationEngine | SGLangEngine
    tokenizer: PreTrainedTokenizerBase
    local: TorchGenerationEngine | None = None
    servers: SGLangEngine | None = None


def build_torch_backend(
    config: RecipeConfig, *, end_ids: tuple[int, ...], placement: Placement, started: ExitStack
) -> EngineBackend:
    """The torch engine on this actor's device; closed by `started`."""
    generation = config.generation
    assert isinstance(generation, TorchGenerationConfig)
    model, tokenizer = build_policy(config.policy, config.run.seed)
    # transformers' `to` is typed as unbound (see gymrl.model.loading.build_tiny_llama).
    model.to(placement.generation.device)  # pyright: ignore[reportArgumentType]
    engine = TorchGenerationEngine.from_config(
        model,
        generation,
        seed=config.run.seed,
        compute_dtype=config.policy.compute_dtype,
        eos_token_ids=[eos_token_id(tokenizer), *end_ids],
    )
    started.callback(engine.close)
    return EngineBackend(engine, tokenizer, local=engine)


def build_sglang_backend(
    config: RecipeConfig,
    *,
    folder: str,
    end_ids: tuple[int, ...],
    output_dir: Path,
    placement: Placement,
    placement_group: Any,
    started: ExitStack,
) -> EngineBackend:
    """`generation.num_engines` SGLang servers in `placement_group` and the client of them;
    both are closed by `started`."""
    generation = config.generation
    assert isinstance(generation, SGLangGenerationConfig)
    adapters = AdapterServing.of(config.trainer.lora, config.grpo, generation.launch)
    servers = SGLangServerGroup(
        generation,
        config.policy,
        adapters=adapters,
        model_path=folder,
        seed=config.run.seed,
        log_dir=output_dir / "logs",
        placement_group=placement_group,
        engines=placement.generation,
    )
    started.callback(servers.shutdown)
    engine = SGLangEngine.from_config(
        generation,
        servers.urls,
        refit_dir=output_dir / "refit",
        end_token_ids=end_ids,
        route_layout=route_layout(folder) if config.policy.router_replay.enabled else None,
        adapters=adapters,
    )
    started.callback(engine.close)
    return EngineBackend(engine, load_tokenizer(folder), servers=engine)


@dataclass(frozen=True)
class GenerationRole:
    """The running generation server: its actor (refit verbs) and the endpoint its policy server
    answers on (URL, the run's key, the model name), which agents and announcements take from
    here: the role holds all three values, so no caller rebuilds them."""

    actor: Any
    policy: PolicyEndpoint

    def raise_if_engine_failed(self) -> None:
        """Raise the engine's own `EngineFailedError` if a failed step stopped it: what a
        rollout that saw episodes fail asks first, so the run stops with the engine's error
        instead of charging every agent's failed episode to the failure budget."""
        failure = wait_for(
            self.actor.engine_failure.remote(),
            timeout_s=ENGINE_FAILURE_CHECK_S,
            what="asking the generation server whether its engine failed",
        )
        if failure is not None:
            raise failure

    def attach_routes(self, trajectories: Sequence[Trajectory]) -> list[Trajectory]:
        """Router replay: `trajectories` with the routed experts the policy server held for
        their model calls (`RouteStore.assemble`); masked ones, which hold no token, as they
        are. A `RouteSource` of the rollout producer."""
        wanted = [index for index, t in enumerate(trajectories) if not t.is_masked]
        assembled = wait_for(
            self.actor.assemble_routes.remote(
                [(trajectories[i].token_ids, trajectories[i].call_ends) for i in wanted]
            ),
            timeout_s=ROUTE_ASSEMBLY_S,
            what="collecting the episodes' routed experts from the generation server",
        )
        attached = list(trajectories)
        for index, routes in zip(wanted, assembled, strict=True):
            attached[index] = dataclasses.replace(attached[index], routed_experts=routes)
        return attached


def start_timeout_s(config: RecipeConfig) -> float:
    """Deadline for the generation server: model loading, plus SGLang's own start deadline."""
    generation = config.generation
    engines = generation.server_start_timeout_s if generation.backend == "sglang" else 0.0
    return config.cluster.ray_start_timeout_s + engines


def start_generation_server(
    config: RecipeConfig,
    *,
    output_dir: Path,
    torch_threads: int,
    placement: Placement,
    group: Any,
    api_key: SecretStr,
    on_cleanup: OnCleanup,
    episode_deadline_s: float | None,
    sampling_rules: SamplingRules | None = None,
) -> GenerationRole:
    """Start the generation server where `placement` says, in the run's placement `group`, and
    wait (with a deadline) until its policy server answers. A training run passes its
    `sampling_rules` (`gymrl.generation.server.sampling_rules`); serving and evaluating sample what
    each request asks. `episode_deadline_s` is the run's episode deadline where the run's own
    episodes are the only clients (`env.rollout.run_timeout_s`), None where anyone may call."""
    actor = GenerationServer.options(**actor_options(placement.policy_server, 0, group)).remote(
        config,
        output_dir=str(output_dir),
        torch_threads=torch_threads,
        placement=placement,
        placement_group=group,
        api_key=api_key,
        sampling_rules=sampling_rules,
        episode_deadline_s=episode_deadline_s,
    )
    on_cleanup("the generation server", lambda: close_actor(actor, timeout_s=GENERATION_CLOSE_S))
    base_url = wait_for(
        actor.base_url.remote(),
        timeout_s=start_timeout_s(config),
        what="starting the generation server",
    )
    return GenerationRole(
        actor, PolicyEndpoint(base_url, api_key.get_secret_value(), config.policy.name)
    )

"""The SGLang engine: a token-in/token-out client of SGLang servers over their native HTTP API.

The servers are `gymrl.generation.sglang.servers`; nothing here imports SGLang (its pinned
environment is not the recipe's). The client is tested against the real server on a CPU
(`tests/gymrl/generation/sglang/test_real_server.py`) and, in the default suite, against a
stand-in (`tests/support/sglang_standin/`) whose routes and request fields the contract test
(`test_contract.py` beside the first) checks against the pinned wheel's own source. Every answer's
`meta_info.weight_version` must be one the engine's servers hold (the servers start at version
0, `--weight-version 0`): a server that restarted or missed a refit stops generation.

The HTTP API used (SGLang 0.5.23, pinned exactly: `sglang/srt/entrypoints/http_server.py` and
`managers/io_struct.py`; docs/cluster.md says which of its behaviours the engine relies on):

* `POST /generate` with `input_ids`, `sampling_params` (`max_new_tokens`, `temperature`, `top_p`,
  `stop_token_ids`, `sampling_seed`), `return_logprob: true`, `logprob_start_len: -1` (log-probs of
  output tokens only; no prompt log-probs are computed). The answer carries
  `meta_info.output_token_logprobs` as `[logprob, token_id, text|null]` triples, one per sampled
  token (the stop token included), `meta_info.completion_tokens` and `meta_info.finish_reason`
  (`{"type": "stop"|"length"|"abort", ...}`). Besides the request's stop ids the server stops at
  the model's own end ids (`config.json` and `generation_config.json` `eos_token_id`), which the
  engine is given as `end_token_ids` for the abort cut. With router replay the body adds
  `return_routed_experts: true` and `routed_experts_start_len` (at most the prompt's length),
  and the answer carries `meta_info.routed_experts` (:func:`parse_routed_experts`).
* `POST /pause_generation {"mode": "abort"}`, `POST /update_weights_from_disk {"model_path",
  "weight_version", "flush_cache": false}`, `POST /flush_cache`, `POST /continue_generation {}`:
  the refit sequence (the broadcast's own calls are `gymrl.generation.sglang.weight_sync`'s).
* `POST /weights_checker {action, skip_tensor_list}`: the weight check around a refit,
  `gymrl.generation.sglang.refit_checks.weights_checker`'s.
* `GET /health_generate`: 200 once the server generates.
* A LoRA run's refits (:meth:`SGLangEngine.update_adapter`, `gymrl.generation.sglang.adapters`):
  `POST /load_lora_adapter_from_tensors {"lora_name", "config_dict", "serialized_named_tensors",
  "expected_checksums"}` and `POST /unload_lora_adapter {"lora_name"}`, whose answers carry
  `success`, `error_message` and `loaded_adapters`; `/generate` then names the adapter with
  `lora_path`.

**Log-probability semantics.** The project defines generation log-probabilities as those of the
sampled token under `softmax(logits / temperature)`, before top-p truncation. SGLang's sampler
returns exactly that by default (`log(probs)` after the temperature division and before top-k/top-p
filtering; a temperature of 0 is greedy and reports the untempered softmax, as the torch engine
does). The environment variable `SGLANG_RETURN_ORIGINAL_LOGPROB` switches SGLang to the
pre-temperature distribution, so the server is always started with it removed.

**Refit.** Generation and training run on different GPUs, so `/update_weights_from_tensor`
(CUDA IPC handles, colocated only) does not apply. Either the trainer's rank 0 broadcasts the
weights to every server over a process group (`generation.refit.transport: nccl`,
`gymrl.generation.sglang.weight_sync`), paused and resumed by :meth:`SGLangEngine.begin_refit` and
:meth:`SGLangEngine.end_refit`, or each server loads a Hugging Face safetensors checkpoint from a
shared filesystem with `/update_weights_from_disk` (`transport: disk`, :meth:`refit_from_disk`):
one write plus parallel reads of the checkpoint per step, and no process group that must be
rebuilt when an engine restarts. Either way the refit runs between :meth:`begin_refit` and
:meth:`end_refit`, which is where the weights are checked (`generation.refit.verify_method:
weights_checker`, :class:`~gymrl.generation.sglang.refit_checks.weights_checker.WeightsChecker`):
before anything is sent and after everything loaded, while no request runs.

SGLang takes the weight-update lock only once no request holds it, and paused requests still
hold it (a "retract" or "in_place" pause deadlocks the update), so generation is paused with
`mode: "abort"`: in-flight requests come back with the tokens sampled so far and finish reason
`abort`. The engine resubmits each such request, prompt plus partial generation, and the server
holds it until generation continues under the new weights. Every token's log-probability is the
one its sampler reported, which is what the importance-sampling correction needs; an output's
`weight_version` is the oldest version that contributed tokens. An aborted request decodes once
more before it stops, and that token may end the turn (:func:`cut_at_stop_token`); a request
admitted just before the pause is aborted too and resumed like the others; `/flush_cache` is
refused until the scheduler is idle and is retried until `FLUSH_DEADLINE_S`.
"""

from __future__ import annotations

import asyncio
import base64
import math
import os
import shutil
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import torch
from safetensors.torch import save_file

from gymrl.config.schema.generation import SGLangGenerationConfig
from gymrl.generation.sglang.adapters import (
    AdapterServing,
    adapter_name,
    check_adapter,
    load_request,
)
from gymrl.generation.sglang.refit_checks.weights_checker import (
    WeightCheckUnavailableError,
    WeightsChecker,
    checker_for,
)
from gymrl.generation.sglang.routing import PrefixRouter, Routing
from gymrl.generation.types import (
    EngineFailedError,
    FinishReason,
    GenerationOutput,
    GenerationRequest,
    RoutedExperts,
    RouteLayout,
    UnsupportedRequestError,
)
from gymrl.run.adapter import AdapterWeights
from gymrl.run.atomic import atomic_folder
from nemo_gym_ext.keep_alive import CLIENT_KEEPALIVE_EXPIRY_S

MAX_RESUMES = 8
# Refusals of /flush_cache after a pause last while aborted requests leave the scheduler.
FLUSH_DEADLINE_S = 60.0
_JSON_HEADERS = {"content-type": "application/json"}
_WEIGHTS_FILE = "model.safetensors"


class SGLangError(RuntimeError):
    """A server answered with an error, an unusable response, or not at all."""


class SGLangTimeoutError(SGLangError, TimeoutError):
    """A server did not answer within its deadline."""


def generate_payload(
    prompt_token_ids: Sequence[int],
    request: GenerationRequest,
    budget: int,
    routes_from: int | None = None,
    lora_path: str | None = None,
):
    """The `/generate` body for `prompt_token_ids` with at most `budget` new tokens; with
    `routes_from`, asking for the experts each position from there on was routed to; with
    `lora_path`, generated under that loaded adapter (a LoRA run's version)."""
    params = request.params
    sampling: dict[str, Any] = {
        "max_new_tokens": budget,
        "temperature": params.temperature,
        "top_p": params.top_p,
    }
    if params.stop_token_ids:
        sampling["stop_token_ids"] = list(params.stop_token_ids)
    if params.seed is not None:
        # Honoured by SGLang only under --enable-deterministic-inference; otherwise ignored.
        sampling["sampling_seed"] = params.seed
    payload: dict[str, Any] = {
        "input_ids": list(prompt_token_ids),
        "sampling_params": sampling,
        "return_logprob": True,
        "logprob_start_len": -1,
    }
    if routes_from is not None:
        payload["return_routed_experts"] = True
        payload["routed_experts_start_len"] = routes_from
    if lora_path is not None:
        payload["lora_path"] = lora_path
    return payload


def parse_routed_experts(
    url: str,
    body: Any,
    layout: RouteLayout,
    *,
    start: int,
    sequence_length: int,
    aborted: bool,
) -> RoutedExperts | None:
    """The routes of one `/generate` answer asked from position `start` of a sequence of
    `sequence_length` tokens (prompt plus this answer's tokens).

    SGLang returns `meta_info.routed_experts` as base64 of little-endian int32
    `[sequence_length - 1 - start, layers, top-k]` (`sglang/srt/state_capturer/routed_experts.py`).
    An aborted answer may carry none (aborted while waiting): None. A finished answer without
    them is a server started without `--enable-return-routed-experts`; rows of another count
    could not be placed on positions (SGLang itself logs such a mismatch as a bug): both raise.
    """
    encoded = body["meta_info"].get("routed_experts")
    where = f"SGLang server {url}: /generate answer"
    if encoded is None:
        if aborted:
            return None
        raise SGLangError(
            f"{where} has no meta_info.routed_experts although return_routed_experts was true; "
            "the server must run with --enable-return-routed-experts "
            "(policy.router_replay.enabled adds it)"
        )
    flat = np.frombuffer(base64.b64decode(encoded), dtype="<i4")
    per_position = layout.num_layers * layout.experts_per_token
    expected = max(0, sequence_length - 1 - start)
    if flat.size != expected * per_position:
        raise SGLangError(
            f"{where}: routed_experts holds {flat.size} ids, expected {expected} positions x "
            f"{layout.num_layers} layers x {layout.experts_per_token} experts (from position "
            f"{start} of {sequence_length})"
        )
    rows = flat.reshape(expected, layout.num_layers, layout.experts_per_token)
    try:
        return RoutedExperts(start=start, rows=layout.narrowed(rows))
    except ValueError as error:
        raise SGLangError(f"{where}: {error}") from error


def joined_routes(
    pieces: Sequence[RoutedExperts], layout: RouteLayout, *, start: int, end: int
) -> RoutedExperts:
    """Pieces that follow each other from `start` (a resumed generation's: each asked from
    where the previous one stopped), as one run cut at `end`: a generation whose last piece
    was cut at a stop token ends earlier than that piece's routes."""
    empty = np.empty((0, layout.num_layers, layout.experts_per_token), dtype=layout.dtype)
    joined = np.concatenate([empty, *(piece.rows for piece in pieces)])
    return RoutedExperts(start=start, rows=joined[: max(0, end - start)])


def parse_generate_response(url: str, body: Any) -> tuple[list[int], list[float], str, str]:
    """`(token_ids, logprobs, finish_type, abort_message)` of one `/generate` answer.

    Tokens and log-probabilities both come from `output_token_logprobs`, whose count is checked
    against `completion_tokens`, an independent count of the sampled tokens.
    """
    where = f"SGLang server {url}: /generate answer"
    try:
        meta = body["meta_info"]
        finish = meta["finish_reason"]
        finish_type = finish["type"]
    except (KeyError, TypeError) as error:
        raise SGLangError(
            f"{where} lacks meta_info.finish_reason.type: {str(body)[:300]}"
        ) from error
    entries = meta.get("output_token_logprobs")
    if entries is None:
        if finish_type != "abort":
            raise SGLangError(
                f"{where} has no meta_info.output_token_logprobs although return_logprob was "
                "true; is this an SGLang server?"
            )
        entries = []  # aborted while waiting: nothing was sampled
    token_ids: list[int] = []
    logprobs: list[float] = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, list | tuple) or len(entry) < 2:
            raise SGLangError(
                f"{where}: output_token_logprobs[{index}] is {entry!r}, expected "
                "[logprob, token_id, text]"
            )
        logprob, token = entry[0], entry[1]
        if not isinstance(logprob, int | float) or math.isnan(logprob):
            raise SGLangError(f"{where}: output_token_logprobs[{index}] has logprob {logprob!r}")
        token_ids.append(int(token))
        logprobs.append(float(logprob))
    if finish_type != "abort" and meta.get("completion_tokens") != len(token_ids):
        raise SGLangError(
            f"{where}: {len(token_ids)} output_token_logprobs but completion_tokens="
            f"{meta.get('completion_tokens')!r}"
        )
    message = str(finish.get("message", "")) if finish_type == "abort" else ""
    return token_ids, logprobs, finish_type, message


class SGLangEngine:
    """A :class:`~gymrl.generation.types.GenerationEngine` backed by SGLang servers over HTTP.

    Each request is one `/generate` call, sent to the server whose prefix cache most likely holds
    the longest start of its prompt (:class:`~gymrl.generation.sglang.routing.PrefixRouter`; a turn
    of a multi-turn episode follows its episode) or, with `routing="least_loaded"` or when that
    server is much busier, to the one with the fewest requests in flight from this client (ties go
    round-robin); SGLang batches concurrent requests itself, so the
    policy server submits each chat request alone (:meth:`submit`). Calls run on a private
    asyncio loop, so `generate` may be called from many threads at once and a batch of requests
    is in flight together. Every HTTP call has a deadline.
    """

    def __init__(
        self,
        server_urls: Sequence[str],
        *,
        request_timeout_s: float,
        refit_timeout_s: float,
        refit_dir: str | os.PathLike[str] | None = None,
        weight_version: int = 0,
        routing: Routing = "cache_aware",
        end_token_ids: Iterable[int] = (),
        weights_checker: WeightsChecker | None = None,
        honours_seeds: bool = False,
        route_layout: RouteLayout | None = None,
        adapters: AdapterServing | None = None,
        tensor_parallel_size: int = 1,
    ) -> None:
        """`end_token_ids`: the model's own end ids, where the servers stop every request
        whatever its stop ids (:func:`gymrl.model.tokens.model_end_token_ids`).
        `weights_checker`: the check each refit gets; None: none. The servers hold the weights
        of `weight_version` when the engine starts. `honours_seeds`: the servers run with
        `--enable-deterministic-inference`, the only mode in which SGLang uses a request's
        `sampling_seed`; without it a request with a seed is refused. `route_layout`: the MoE
        model's routes, when the servers capture them for router replay
        (`--enable-return-routed-experts`); a request with `routes_from` needs it.
        `adapters`: a LoRA run's, whose servers were started with its flags; refits are then
        :meth:`update_adapter`'s. `tensor_parallel_size`: each server's ranks (an adapter load
        carries one copy of the tensors per rank)."""
        if not server_urls:
            raise ValueError("SGLangEngine needs at least one server URL")
        urls = [url.rstrip("/") for url in server_urls]
        repeated = sorted({url for url in urls if urls.count(url) > 1})
        if repeated:
            # Two concurrent updates to one SGLang server break its tokenizer manager.
            raise ValueError(
                f"server_urls lists {repeated} more than once; each SGLang server must be "
                "listed once (a refit sends each listed URL its own update, and SGLang fails "
                "on two at once)"
            )
        if request_timeout_s <= 0 or refit_timeout_s <= 0:
            raise ValueError(
                f"request_timeout_s={request_timeout_s} and refit_timeout_s={refit_timeout_s} "
                "must be > 0"
            )
        self._urls = urls
        self._honours_seeds = honours_seeds
        self._route_layout = route_layout
        self._request_timeout_s = request_timeout_s
        self._refit_timeout_s = refit_timeout_s
        self._refit_dir = None if refit_dir is None else Path(refit_dir)
        self._end_ids = frozenset(int(token) for token in end_token_ids)
        self._version = weight_version
        # A LoRA run: the servers keep the base weights (version `weight_version` all run) and
        # each refit loads an adapter; `_loaded` are the versions loaded, oldest first, and
        # `_lora_path` the name requests send (None until the first adapter refit: the base).
        self._adapters = adapters
        self._tp_size = tensor_parallel_size
        self._base_version = weight_version
        self._loaded: list[int] = []
        self._lora_path: str | None = None
        self._checker = weights_checker
        # Refits begun and completed; an abort while they differ, or after a later one began,
        # is a refit's.
        self._refits_started = 0
        self._refits_finished = 0
        self._loading: int | None = None  # the version a begun refit loads
        self._router = PrefixRouter(len(self._urls), routing=routing)
        self._state_lock = threading.Lock()
        self._refit_lock = threading.RLock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="sglang-engine-loop", daemon=True
        )
        self._thread.start()
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(request_timeout_s),
            limits=httpx.Limits(
                max_connections=None,
                max_keepalive_connections=None,
                keepalive_expiry=CLIENT_KEEPALIVE_EXPIRY_S,
            ),
        )

    @classmethod
    def from_config(
        cls,
        generation: SGLangGenerationConfig,
        server_urls: Sequence[str],
        *,
        refit_dir: str | os.PathLike[str] | None = None,
        end_token_ids: Iterable[int] = (),
        route_layout: RouteLayout | None = None,
        adapters: AdapterServing | None = None,
    ) -> SGLangEngine:
        """A client of `server_urls` with the config's deadlines (`route_layout`: with router
        replay; `adapters`: a LoRA run's; see :class:`SGLangEngine`).

        A refit loads a checkpoint, which takes about as long as loading it at start-up, so it
        shares the start-up deadline.
        """
        if len(server_urls) != generation.num_engines:
            raise ValueError(
                f"got {len(server_urls)} server URLs but generation.num_engines="
                f"{generation.num_engines}"
            )
        return cls(
            server_urls,
            request_timeout_s=generation.server.request_timeout_s,
            refit_timeout_s=generation.server_start_timeout_s,
            refit_dir=refit_dir,
            routing=generation.routing,
            end_token_ids=end_token_ids,
            weights_checker=checker_for(generation.refit),
            honours_seeds=generation.launch.deterministic_inference,
            route_layout=route_layout,
            adapters=adapters,
            tensor_parallel_size=generation.tensor_parallel_size,
        )

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def server_urls(self) -> list[str]:
        return list(self._urls)

    # ----------------------------------------------------------------------------- generation
    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        for index, request in enumerate(requests):
            self._validate(index, request)
        if not requests:
            return []
        # Each piece of a request has its own HTTP deadline; resumes after refits are bounded.
        bound = (self._request_timeout_s + self._refit_timeout_s) * (MAX_RESUMES + 1)
        return self._run(self._generate_all(requests), bound)

    def failure(self) -> EngineFailedError | None:
        """None: this client has no step of its own that can fail for good; a server's failure
        reaches each request as that server's HTTP error."""
        return None

    def submit(self, request: GenerationRequest) -> Future[GenerationOutput]:
        """Start one request on the engine's loop (see `RequestScheduler`); the caller bounds it."""
        self._validate(0, request)
        return asyncio.run_coroutine_threadsafe(self._generate_one(request), self._loop)

    async def _generate_all(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._generate_one(request)) for request in requests]
        except ExceptionGroup as failures:
            # The other requests were cancelled; report the first cause, not a group.
            raise failures.exceptions[0] from None
        return [task.result() for task in tasks]

    async def _generate_one(self, request: GenerationRequest) -> GenerationOutput:
        """One request, resumed (prompt plus tokens so far) after each refit that aborts it.

        An abort is the refit's when a refit was under way when the piece was sent or started
        after it: a request admitted between the engine starting a refit and the server pausing
        is aborted by that pause too, and is resumed like the others, not failed.

        With `routes_from`, each piece asks for the routes of the positions not yet covered, so
        a resumed generation keeps the routes its tokens were generated with (those of an
        aborted piece, where its answer carries them), and only positions no piece reported are
        routed again, under the weights the generation resumes with.
        """
        prompt = list(request.prompt_token_ids)
        stops = frozenset(request.params.stop_token_ids) | self._end_ids
        tokens: list[int] = []
        logprobs: list[float] = []
        routes: list[RoutedExperts] = []
        version: int | None = None
        for _attempt in range(MAX_RESUMES + 1):
            with self._state_lock:
                refits_finished, current = self._refits_finished, self._version
                lora_path = self._lora_path
            version = current if version is None else min(version, current)
            budget = request.params.max_new_tokens - len(tokens)
            sent = prompt + tokens
            routes_from = self._routes_from(request, routes)
            server = self._acquire(sent)
            url = self._urls[server]
            answered: list[int] | None = None
            try:
                body = await self._post(
                    url,
                    "/generate",
                    generate_payload(sent, request, budget, routes_from, lora_path),
                )
                new_tokens, new_logprobs, finish, message = parse_generate_response(url, body)
                if finish != "abort":
                    self._check_server_version(url, body, current)
                answered = sent + new_tokens
            finally:
                self._release(server, answered)
            if routes_from is not None:
                piece = parse_routed_experts(
                    url,
                    body,
                    self._layout(),
                    start=routes_from,
                    sequence_length=len(sent) + len(new_tokens),
                    aborted=finish == "abort",
                )
                routes += [piece] if piece is not None else []
            if finish == "abort":
                new_tokens, finish = cut_at_stop_token(new_tokens, stops)
                new_logprobs = new_logprobs[: len(new_tokens)]
            tokens += new_tokens
            logprobs += new_logprobs
            if finish in ("stop", "length"):
                return self._output(request, prompt, tokens, logprobs, finish, version, routes)
            if finish != "abort":
                raise SGLangError(f"SGLang server {url}: unknown finish_reason.type {finish!r}")
            with self._state_lock:
                refit_caused = self._refits_started > refits_finished
            if not refit_caused:
                raise SGLangError(f"SGLang server {url} aborted the request: {message}")
            if len(tokens) >= request.params.max_new_tokens:
                return self._output(request, prompt, tokens, logprobs, "length", version, routes)
        raise SGLangError(
            f"a generation was interrupted by {MAX_RESUMES + 1} refits without finishing; refits "
            "come faster than one generation takes: lower max_new_tokens or refit less often"
        )

    def _layout(self) -> RouteLayout:
        if self._route_layout is None:  # _validate refuses such requests before they run
            raise ValueError("this engine was made without a route layout")
        return self._route_layout

    @staticmethod
    def _routes_from(request: GenerationRequest, routes: Sequence[RoutedExperts]) -> int | None:
        """The first position the next piece asks routes for: the request's, or past the
        positions earlier pieces covered."""
        if request.routes_from is None:
            return None
        return routes[-1].end if routes else request.routes_from

    def _output(
        self,
        request: GenerationRequest,
        prompt: list[int],
        tokens: list[int],
        logprobs: list[float],
        finish: str,
        version: int,
        routes: Sequence[RoutedExperts],
    ) -> GenerationOutput:
        routed = None
        if request.routes_from is not None:
            routed = joined_routes(
                routes,
                self._layout(),
                start=request.routes_from,
                end=len(prompt) + len(tokens) - 1,
            )
        return GenerationOutput(
            token_ids=tokens,
            logprobs=logprobs,
            finish_reason=_finish_reason(finish),
            weight_version=version,
            prompt_token_ids=prompt,
            routed_experts=routed,
        )

    def _check_server_version(self, url: str, body: Any, sent_under: int) -> None:
        """The answer's `meta_info.weight_version` is one this engine's servers may hold: the
        version the request was sent under, the engine's now, or the one a refit under way
        loads (a request sent during a refit runs once it is over). Anything else is a server
        that missed a refit or restarted (a restarted server holds `policy.model`'s weights,
        version 0): mixed weights, which must stop the run."""
        reported = body["meta_info"].get("weight_version")
        with self._state_lock:
            allowed = {sent_under, self._version, self._loading}
        if self._adapters is not None:  # adapter refits leave the base weights as they started
            allowed, sent_under = {self._base_version}, self._base_version
        if reported not in {str(version) for version in allowed if version is not None}:
            raise SGLangError(
                f"SGLang server {url} generated with weight_version {reported!r}, but this "
                f"engine's servers hold version {sent_under}: the server missed a refit or was "
                "restarted (it starts from policy.model's weights, version 0); generation on "
                "mixed weights must stop"
            )

    def _validate(self, index: int, request: GenerationRequest) -> None:
        _check_request(index, request)
        if request.routes_from is not None:
            if self._route_layout is None:
                raise ValueError(
                    f"requests[{index}] asks for routed experts, but this engine was made "
                    "without a route layout (policy.router_replay.enabled=false)"
                )
            if not 0 <= request.routes_from <= len(request.prompt_token_ids):
                raise ValueError(
                    f"requests[{index}].routes_from={request.routes_from} must lie in "
                    f"[0, {len(request.prompt_token_ids)}] (the prompt's tokens)"
                )
        if request.params.seed is not None and not self._honours_seeds:
            raise UnsupportedRequestError(
                f"seed={request.params.seed}: the SGLang servers ignore a request's seed unless "
                "started with --enable-deterministic-inference; send no seed, or set "
                "generation.launch.deterministic_inference=true on the server",
                param="seed",
            )

    def _acquire(self, prompt: Sequence[int]) -> int:
        with self._state_lock:
            return self._router.choose(prompt)

    def _release(self, server: int, sequence: Sequence[int] | None) -> None:
        with self._state_lock:
            self._router.release(server, sequence)

    # ---------------------------------------------------------------------------------- refit
    def refit_from_disk(self, path: str | os.PathLike[str], version: int) -> None:
        """Load the Hugging Face checkpoint at `path` (visible to every server) on all servers.

        Sequence, on all servers at once at each stage: pause (aborting in-flight requests,
        which this engine resubmits), update weights, flush the prefix cache (its KV entries
        were computed by the old weights), continue. The weight version changes only once every
        server runs the new weights. A failure leaves the servers paused and raises: a run with
        servers on mixed weights must stop, not train on them.
        """
        model_path = str(Path(path).resolve())
        with self._refit_lock:
            self.begin_refit(version)
            self._run(self._load_from_disk(model_path, version), self._refit_timeout_s + 5.0)
            self.end_refit(version)

    def begin_refit(self, version: int) -> None:
        """Pause every server for weight `version`, which someone else sends (the trainer, by
        broadcast: `gymrl.generation.sglang.weight_sync`), then have the weights checker prepare its
        check; requests aborted by the pause are resumed after :meth:`end_refit`. Holds the
        refit lock until then, on this thread."""
        self._refit_lock.acquire()
        try:
            with self._state_lock:
                self._refits_started += 1
                self._loading = version
            self._run(self._on_all("/pause_generation", {"mode": "abort"}), self._request_timeout_s)
            if self._checker is not None:
                prepare = self._checker.before_refit(
                    self._send, self._urls, resends_held_weights=version == self._version
                )
                try:
                    self._run(prepare, self._checker.bound_s)
                except WeightCheckUnavailableError:
                    # Nothing was randomised: the servers still hold their weights, so they
                    # serve on and the refit never began.
                    self._run(self._on_all("/continue_generation", {}), self._request_timeout_s)
                    with self._state_lock:
                        self._refits_started -= 1
                        self._loading = None
                    raise
        except BaseException:
            self._refit_lock.release()
            raise

    def end_refit(self, version: int) -> None:
        """Check the weights the refit loaded (a mismatch raises, generation stays paused), flush
        every server's prefix cache and continue generation under weight `version`."""
        try:
            if self._checker is not None:
                check = self._checker.after_refit(self._send, self._urls, version)
                self._run(check, self._checker.bound_s)
            self._run(self._resume(), 2 * self._request_timeout_s + FLUSH_DEADLINE_S)
            with self._state_lock:
                self._version = version
                self._loading = None
                self._refits_finished += 1
        finally:
            self._refit_lock.release()

    async def _load_from_disk(self, model_path: str, version: int) -> None:
        # No flush here: a flush the scheduler refuses would fail the update although the
        # weights loaded; end_refit flushes once, with retries.
        update = {"model_path": model_path, "weight_version": str(version), "flush_cache": False}
        answers = await self._on_all("/update_weights_from_disk", update, self._refit_timeout_s)
        failed = {
            url: answer
            for url, answer in zip(self._urls, answers, strict=True)
            if not answer.get("success")
        }
        if failed:
            raise SGLangError(
                f"update_weights_from_disk({model_path}) failed on {sorted(failed)}: "
                f"{next(iter(failed.values())).get('message')!r}; generation stays paused"
            )

    async def _resume(self) -> None:
        await asyncio.gather(*(self._flush_cache(url) for url in self._urls))
        await self._on_all("/continue_generation", {})

    async def _flush_cache(self, url: str) -> None:
        """`/flush_cache`, retried while the server refuses it, until `FLUSH_DEADLINE_S`.

        SGLang refuses (400) unless its scheduler is idle, and after a pause in "abort" mode the
        aborted requests may still be on their way out of the scheduler for a step or two.
        """
        deadline = time.monotonic() + FLUSH_DEADLINE_S
        pause = 0.05
        while True:
            response = await self._send(url, "/flush_cache", None)
            if response.status_code == 200:
                return
            if response.status_code != 400 or time.monotonic() + pause > deadline:
                raise SGLangError(
                    f"SGLang server {url}: POST /flush_cache answered {response.status_code} "
                    f"for {FLUSH_DEADLINE_S} s: {response.text[:300]!r}; requests still run on "
                    "it after the pause; generation stays paused"
                )
            await asyncio.sleep(pause)
            pause = min(2 * pause, 1.0)

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Write `state_dict` (Hugging Face names) as safetensors under the refit directory, then
        :meth:`refit_from_disk`. Meant for models whose weights fit in host memory; the Megatron
        trainer exports its checkpoint itself and calls :meth:`refit_from_disk`.
        """
        if self._refit_dir is None:
            raise ValueError(
                "SGLangEngine.update_weights needs refit_dir (a folder on a filesystem every "
                "SGLang server can read); pass it to SGLangEngine(..., refit_dir=...)"
            )
        target = self._refit_dir / f"weights_v{version}"
        with self._refit_lock:
            with atomic_folder(target, durable=False) as staging:
                # Cloning breaks shared storage (tied embeddings), which safetensors refuses.
                tensors = {
                    name: tensor.detach().to("cpu").contiguous().clone()
                    for name, tensor in state_dict.items()
                }
                save_file(tensors, str(staging / _WEIGHTS_FILE))
            self.refit_from_disk(target, version)
            remove_loaded_refits(self._refit_dir, keep=target)

    def update_adapter(self, adapter: AdapterWeights, version: int) -> None:
        """A LoRA run's refit: every server loads `adapter` from tensors as `policy_v{version}`
        (`gymrl.generation.sglang.adapters`), and every request sent afterwards names it.

        Nothing is paused: a request keeps the adapter it was sent with (its output's
        `weight_version` is that version) and finishes under it, since a version stays loaded
        for the staleness window (`AdapterServing.versions_kept`); the versions older than the
        window are unloaded once the new one is served, SGLang's unload waiting for the
        requests still naming them. The adapter's keys are checked against the servers' target
        modules before anything is sent; a server that refuses the load, or does not list the
        version afterwards, fails the refit naming the server and the version, and requests go
        on naming the previous version (a run must stop on such an error, not train on)."""
        serving = self._adapters
        if serving is None:
            raise ValueError(
                "SGLangEngine.update_adapter needs servers started for adapters (a LoRA run's "
                "`adapters=AdapterServing`, from trainer.lora.enabled)"
            )
        check_adapter(adapter, serving, version)
        with self._refit_lock:
            if self._loaded and version <= self._loaded[-1]:
                raise ValueError(
                    f"adapter version {version} is not newer than the loaded version "
                    f"{self._loaded[-1]}; adapter refits load increasing versions"
                )
            request = load_request(adapter, version, self._tp_size)
            bound = 2 * self._refit_timeout_s + 5.0  # the load, then the unloads
            self._run(self._load_adapter(request, version), bound)

    async def _load_adapter(self, request: Mapping[str, Any], version: int) -> None:
        name = adapter_name(version)
        await asyncio.gather(*(self._load_adapter_on(url, request, version) for url in self._urls))
        serving = self._adapters
        assert serving is not None  # update_adapter's caller checked
        with self._state_lock:
            self._version, self._lora_path = version, name
            self._loaded.append(version)
            stale, self._loaded = (
                self._loaded[: -serving.versions_kept],
                self._loaded[-serving.versions_kept :],
            )
        for old in stale:
            unload = {"lora_name": adapter_name(old)}
            answers = await self._on_all("/unload_lora_adapter", unload, self._refit_timeout_s)
            for url, answer in zip(self._urls, answers, strict=True):
                if not answer.get("success"):
                    raise SGLangError(
                        f"SGLang server {url}: unloading adapter version {old} "
                        f"({adapter_name(old)}) failed: {answer.get('error_message')!r}"
                    )

    async def _load_adapter_on(self, url: str, request: Mapping[str, Any], version: int) -> None:
        name = adapter_name(version)
        response = await self._send(
            url, "/load_lora_adapter_from_tensors", request, self._refit_timeout_s
        )
        try:
            answer = orjson.loads(response.content)
        except orjson.JSONDecodeError:
            answer = {"error_message": response.text[:500]}
        if response.status_code != 200 or not answer.get("success"):
            raise SGLangError(
                f"SGLang server {url}: loading adapter version {version} ({name}) failed "
                f"({response.status_code}): {answer.get('error_message')!r}"
            )
        listed = sorted(answer.get("loaded_adapters") or {})
        if name not in listed:
            raise SGLangError(
                f"SGLang server {url} answered the load of adapter version {version} but does "
                f"not list {name} among its adapters afterwards ({listed}); requests naming it "
                "would fail"
            )

    # ---------------------------------------------------------------------------------- HTTP
    async def _on_all(
        self, route: str, payload: Mapping[str, Any] | None, timeout_s: float | None = None
    ) -> list[Any]:
        return list(
            await asyncio.gather(
                *(self._post(url, route, payload, timeout_s) for url in self._urls)
            )
        )

    async def _post(
        self,
        url: str,
        route: str,
        payload: Mapping[str, Any] | None,
        timeout_s: float | None = None,
    ) -> Any:
        response = await self._send(url, route, payload, timeout_s)
        if response.status_code != 200:
            raise SGLangError(
                f"SGLang server {url}: POST {route} answered {response.status_code}: "
                f"{response.text[:500]}"
            )
        if response.headers.get("content-type", "").startswith("application/json"):
            return orjson.loads(response.content)
        return response.text

    async def _send(
        self,
        url: str,
        route: str,
        payload: Mapping[str, Any] | None,
        timeout_s: float | None = None,
    ) -> httpx.Response:
        timeout = self._request_timeout_s if timeout_s is None else timeout_s
        try:
            content = None if payload is None else orjson.dumps(payload)
            return await self._client.post(
                f"{url}{route}", content=content, headers=_JSON_HEADERS, timeout=timeout
            )
        except httpx.TimeoutException as error:
            raise SGLangTimeoutError(
                f"SGLang server {url}: POST {route} did not answer within {timeout} s (the "
                "server is overloaded or stalled; for /generate raise "
                "generation.server.request_timeout_s or lower max_tokens)"
            ) from error
        except httpx.HTTPError as error:
            raise SGLangError(
                f"SGLang server {url}: POST {route} failed: {type(error).__name__}: {error}"
            ) from error

    def _run(self, coroutine, timeout_s: float):
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(timeout_s)
        except SGLangError:
            raise  # its own deadline error (a TimeoutError too) or a server error
        except TimeoutError as error:
            future.cancel()
            raise SGLangTimeoutError(f"SGLang call did not finish within {timeout_s} s") from error

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        self._run(self._client.aclose(), 30.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30.0)

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def remove_loaded_refits(
    refit_dir: str | os.PathLike[str], *, keep: str | os.PathLike[str]
) -> None:
    """Delete every weight folder under `refit_dir` but `keep`, once every server loaded `keep`.

    A disk refit writes a full checkpoint per step (about 61 GB for a 30B model in bfloat16);
    kept, 200 steps fill 12 TB. Earlier versions, of this run or of the run it resumed, are
    never read again: each refit loads only the newest. `refit_dir` holds nothing else.
    """
    keep_path = Path(keep).resolve()
    folder = Path(refit_dir)
    if not folder.is_dir():
        return
    for entry in folder.iterdir():
        if entry.resolve() != keep_path:
            shutil.rmtree(entry, ignore_errors=True)


def cut_at_stop_token(
    tokens: Sequence[int], stop_token_ids: frozenset[int]
) -> tuple[list[int], str]:
    """The tokens of an aborted answer up to its first stop token, and the finish that implies.

    SGLang (0.5.23, `Req.update_finish_state`) aborts a running request by letting it decode once
    more and then finishing it with `abort` before the stop-token check, so the last token of an
    aborted answer can end the turn. Resuming past it would have the model write after its own
    end of turn; the turn ends there instead (`stop`), as it would have without the abort.
    """
    for index, token in enumerate(tokens):
        if token in stop_token_ids:
            return list(tokens[: index + 1]), "stop"
    return list(tokens), "abort"


def _finish_reason(finish_type: str) -> FinishReason:
    return "stop" if finish_type == "stop" else "length"


def _check_request(index: int, request: GenerationRequest) -> None:
    params, where = request.params, f"requests[{index}]"
    if not request.prompt_token_ids:
        raise ValueError(f"{where}.prompt_token_ids is empty; a prompt needs at least one token")
    if params.max_new_tokens < 1:
        raise ValueError(f"{where}.params.max_new_tokens must be >= 1, got {params.max_new_tokens}")
    if params.temperature < 0:
        raise ValueError(
            f"{where}.params.temperature must be >= 0 (0 is greedy), got {params.temperature}"
        )
    if not 0 < params.top_p <= 1:
        raise ValueError(f"{where}.params.top_p must be in (0, 1], got {params.top_p}")

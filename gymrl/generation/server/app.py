"""The policy model server: OpenAI chat completions in front of a token-in/token-out engine.

NeMo-Gym agents call the policy through its `vllm_model` adapter, which posts non-streaming
`{base_url}/chat/completions` requests (users set `base_url` to `http://host:port/v1`, so the
routes are under `/v1`, besides the unauthenticated `GET /health` that probes poll) and reads
the token bundle (`prompt_token_ids`, `generation_token_ids`, `generation_log_probs`) from
`choices[0].message`. Its `vllm_model_with_compaction` adapter (for Gym's compaction agent) also
sends `required_prefix_token_ids` and measures prompts with `POST {base_url without /v1}/tokenize`,
as vLLM serves it. This server:

* renders messages and tools with the model's own chat template
  (:mod:`gymrl.generation.server.chat_template`), keeping the exact ids clients send back on earlier
  assistant turns (the on-policy prefix fix) when `honor_prompt_token_ids` is set, and starting
  the prompt with exactly the `required_prefix_token_ids` a request names (Gym's exact-prefix
  contract; honoured whatever `honor_prompt_token_ids` says, since the client checks its prompt
  against it), or refusing it by name, never rendering from text instead;
* answers `POST /tokenize` (vLLM's chat form: `{"tokens", "count", "max_model_len"}`) with the
  very rendering a chat completion of the same body would generate from;
* hands each request to the engine alone as it arrives (`RequestScheduler.submit`): both engines
  batch concurrent requests themselves (the torch engine admits a new request into the rows
  already decoding at its next step, SGLang on the server), so no answer waits for the slowest
  generation of a batch;
* parses tool calls and reasoning with the model family's parsers
  (:mod:`gymrl.generation.server.parsers`) into `message.tool_calls` and `reasoning_content`, and
  answers a full OpenAI `ChatCompletion`, plus two extras on the message: the token bundle and
  `weight_version` (the engine's weight version that produced the answer, so rollouts can be aged
  in the replay buffer).

Requests and answers are the wire types of `nemo_gym_ext.wire`, the module the Gym agents read
them with; this module adds only what the server refuses (:class:`PolicyServerRequest`).

Errors use OpenAI's `{"error": {"message", "type", "param", "code"}}` shape. A prompt that leaves
no room in the context is a 400 whose message contains "maximum context length", which the
`vllm_model` adapter turns into an empty `finish_reason: "length"` answer (the episode ends);
`/tokenize` counts such a prompt without refusing it, as vLLM's does, so a client can measure it.

No `/v1/responses`: every Gym agent reaches a policy through one of Gym's model servers (an agent
names its model server by Gym server name), and the `vllm_model` adapters call this server's
`/v1/chat/completions`; their Responses-native mode, the one that would call `/v1/responses`,
refuses token ids (`return_token_id_information`) and compaction alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import Field, SecretStr, StrictInt, field_validator, model_validator
from starlette.exceptions import HTTPException

from gymrl.generation.server.api_error import ApiError
from gymrl.generation.server.chat_template import (
    ChatFormat,
    ChatFormatError,
    PromptTokens,
    build_prompt_after_required_prefix,
    build_prompt_token_ids,
)
from gymrl.generation.server.divergence_watch import DivergenceWatch, Verdict
from gymrl.generation.server.render_worker import RenderWorker
from gymrl.generation.server.request_body import BodyBound
from gymrl.generation.server.route_store import RouteStore, routes_from
from gymrl.generation.server.sampling_rules import Sampling, SamplingMismatchError, SamplingParity
from gymrl.generation.types import (
    EngineFailedError,
    EngineUnavailableError,
    GenerationOutput,
    GenerationRequest,
    RequestScheduler,
    SamplingParams,
    UnsupportedRequestError,
)
from nemo_gym_ext.http_server import describe_validation_errors
from nemo_gym_ext.retry import retry_after_header
from nemo_gym_ext.wire import (
    LOGPROB_TOLERANCE,
    MAX_TEMPERATURE,
    WITHHELD_FINISH_REASON,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChatMessage,
    ChoiceLogprobs,
    ModelCard,
    ModelList,
    TokenizeAnswer,
    TokenLogprob,
    ToolSpec,
    Usage,
)

_OWNER = "gym-grpo-recipes"
logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# The request this server accepts (the wire types are nemo_gym_ext.wire's)
# ---------------------------------------------------------------------------------------------


class PolicyServerRequest(ChatCompletionRequest):
    """A chat completion request, refusing what this server cannot honour.

    Refused: `stream`, `n > 1`, `top_logprobs`, `stop` strings and a forced `tool_choice`, each
    with the fix; seeds outside [0, 2**64); a boolean where a count or a seed belongs (JSON's
    `true` is not 1); a temperature above OpenAI's 2; two tools of one name (the model could not
    tell which one it calls); sent-back log-probabilities that are not finite and <= 0; a `tool`
    message whose `tool_call_id` answers no call of an earlier assistant message. Text that is
    not Unicode (lone surrogates, which JSON can encode but the tokenizer cannot) is refused by
    the JSON parser: validate bodies with `nemo_gym_ext.json_body`, as the server does.
    `parallel_tool_calls` is accepted and not enforced: every parsed tool call is returned.
    `temperature` and `top_p` stay null when left out, so that a training server can tell "not
    sent" from "sent at OpenAI's default" (`gymrl.generation.server.sampling_rules`). A `max_tokens`
    beyond the context is not an error: generation stops at the context's end
    (`finish_reason: "length"`), as vLLM does. `required_prefix_token_ids` is checked where it
    is rendered (against the vocabulary and the history: `build_prompt_after_required_prefix`).
    """

    temperature: float | None = Field(default=None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    seed: StrictInt | None = None
    n: StrictInt = 1
    top_logprobs: StrictInt | None = None

    @field_validator("stream")
    @classmethod
    def _no_streaming(cls, value: bool) -> bool:
        if value:
            raise ValueError("stream=true is not supported; send stream=false (or leave it out)")
        return value

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError(f"n={value} is not supported; send n=1 and one request per sample")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _no_alternatives(cls, value: int | None) -> int | None:
        if value:
            raise ValueError(
                f"top_logprobs={value} is not supported; only the sampled token's log-probability "
                "is returned, so send top_logprobs=0"
            )
        return value

    @field_validator("stop")
    @classmethod
    def _no_stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        if value:
            raise ValueError(
                f"stop={value!r} is not supported; generation stops at the end of the assistant "
                "turn; leave `stop` out"
            )
        return value

    @field_validator("seed")
    @classmethod
    def _seed_in_range(cls, value: int | None) -> int | None:
        # Checked here, not only in the engine: there it would fail the whole batch.
        if value is not None and not 0 <= value < 2**64:
            raise ValueError(f"seed={value} is out of range; send an integer in [0, 2**64)")
        return value

    @field_validator("tools")
    @classmethod
    def _distinct_tool_names(cls, tools: list[ToolSpec] | None) -> list[ToolSpec] | None:
        first: dict[str, int] = {}
        for index, tool in enumerate(tools or ()):
            earlier = first.setdefault(tool.function.name, index)
            if earlier != index:
                raise ValueError(
                    f"tools[{index}] is named {tool.function.name!r} like tools[{earlier}]; "
                    "give every tool its own name (the model calls a tool by name)"
                )
        return tools

    @model_validator(mode="after")
    def _history_as_the_server_answered_it(self) -> PolicyServerRequest:
        calls: set[str] = set()
        for index, message in enumerate(self.messages):
            where = f"messages[{index}]"
            for position, value in enumerate(message.generation_log_probs or ()):
                if not (math.isfinite(value) and value <= LOGPROB_TOLERANCE):
                    raise ValueError(
                        f"{where}.generation_log_probs[{position}] = {value!r}: a "
                        "log-probability is finite and <= 0; send the list back unchanged from "
                        "the server's answer"
                    )
            calls.update(call.id for call in message.tool_calls or ())
            if message.role == "tool" and message.tool_call_id not in calls:
                raise ValueError(
                    f"{where}.tool_call_id = {message.tool_call_id!r} answers no tool call of "
                    "an earlier assistant message; send the assistant message with its "
                    "tool_calls (ids as the server returned them) before the tool's answer"
                )
        return self

    @property
    def starts_segment(self) -> bool:
        """`required_prefix_token_ids` sent as null: the client declares that this call starts a
        segment (Gym's compaction agent rewrote the history it renders from), so its prompt is
        not meant to extend the previous answer. Leaving the field out declares nothing.

        Gym 0.7.0's vllm_model_with_compaction adapter does send the null: it sets the field on
        the chat request it builds from every Responses call, so its `model_dump(exclude_unset=
        True)` keeps it (measured: every call of `+experiment=compaction_gym` without a prefix
        arrived with the field set and null). Its plain vllm_model adapter refuses the field."""
        return (
            self.required_prefix_token_ids is None
            and "required_prefix_token_ids" in self.model_fields_set
        )

    @field_validator("tool_choice")
    @classmethod
    def _auto_tool_choice(cls, value: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if value not in (None, "auto"):
            raise ValueError(
                f"tool_choice={value!r} is not supported; the model decides whether to call a "
                "tool, so send tool_choice='auto' or leave it out"
            )
        return value


# ---------------------------------------------------------------------------------------------
# Waiting for the engine
# ---------------------------------------------------------------------------------------------


class GenerationTimeoutError(TimeoutError):
    """A request's generation did not finish within the server's request timeout."""


async def await_generation(
    future: Future[GenerationOutput], *, timeout_s: float
) -> GenerationOutput:
    """The output of `future`; on timeout it is cancelled and :class:`GenerationTimeoutError`."""
    try:
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
    except TimeoutError as error:
        raise GenerationTimeoutError(
            f"generation did not finish within request_timeout_s={timeout_s} s (the engine is "
            "overloaded or stalled); retry later, lower max_tokens, or raise the server's "
            "request_timeout_s"
        ) from error


# ---------------------------------------------------------------------------------------------
# The steps of a chat completion, each usable without HTTP
# ---------------------------------------------------------------------------------------------


def check_model(body: PolicyServerRequest, model_name: str) -> None:
    """A request naming another model is a 404, so a client pointed at the wrong server learns it
    at once; one naming none is served (OpenAI requires the field, vLLM does not)."""
    if body.model is not None and body.model != model_name:
        raise ApiError(
            404,
            f"model {body.model!r} is not served here; this server serves {model_name!r} "
            "(set the client's `model` to it)",
            error_type="not_found_error",
            param="model",
        )


def resolve_sampling(body: PolicyServerRequest, parity: SamplingParity | None) -> Sampling:
    """The temperature and top-p to generate at: the run's rules decide with `parity` (a training
    run's server; a refused mismatch is a 400 naming the field), else the request, OpenAI's
    defaults (1.0) filling what it leaves out."""
    if parity is None:
        return Sampling(
            1.0 if body.temperature is None else body.temperature,
            1.0 if body.top_p is None else body.top_p,
        )
    try:
        return parity.resolve(body.temperature, body.top_p)
    except SamplingMismatchError as error:
        raise ApiError(
            400, str(error), error_type="invalid_request_error", param=error.param
        ) from error


def max_new_tokens(
    body: PolicyServerRequest, prompt_len: int, default_max_tokens: int, max_context_tokens: int
) -> int:
    """What the request asks for (`max_tokens`, else `max_completion_tokens`, else the server's
    default), clamped to the room the prompt leaves in the context, as vLLM does: a long ask ends
    at the context with `finish_reason: "length"`. A prompt that leaves no room is a 400 whose
    message holds "maximum context length", which Gym's `vllm_model` adapter turns into the end
    of the episode."""
    room = max_context_tokens - prompt_len
    if room < 1:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_context_tokens} tokens, but the prompt "
            f"is {prompt_len} tokens long, which leaves no room to generate; shorten the "
            "conversation or raise the server's max_context_tokens",
            error_type="invalid_request_error",
            param="messages",
        )
    requested = body.max_tokens or body.max_completion_tokens or default_max_tokens
    return min(requested, room)


def engine_error(error: Exception) -> ApiError:
    """The answer to a generation that raised `error`: a timeout is a 504; an engine that cannot
    take requests now a 503 (clients retry after Retry-After); an engine stopped for good a 500
    without Retry-After (every retry would fail alike, `GET /health` names it); anything else a
    500 naming the exception; a request the engine cannot honour (a seed SGLang would ignore) a
    400 naming the field, which clients do not retry."""
    if isinstance(error, GenerationTimeoutError):
        return ApiError(504, str(error), error_type="timeout_error")
    if isinstance(error, EngineUnavailableError):
        return ApiError(503, str(error), error_type="service_unavailable_error")
    if isinstance(error, EngineFailedError):
        return ApiError(500, str(error), error_type="server_error")
    if isinstance(error, UnsupportedRequestError):
        return ApiError(400, str(error), error_type="invalid_request_error", param=error.param)
    return ApiError(
        500, f"engine.generate failed: {type(error).__name__}: {error}", error_type="server_error"
    )


@dataclass(frozen=True)
class ChatCompletions:
    """`POST /v1/chat/completions` over the server's settings, as the steps :meth:`answer` runs:
    check the model, resolve the sampling, render (and check for divergence), withhold or
    generate, respond. Each step is a method or a function of its own, so a test can run one
    without HTTP; the app only reads the body and hands it here. `POST /tokenize` is
    :meth:`tokenize`: the same model check and rendering, nothing generated.

    With `sampling_parity` (a training run's server) each request's sampling is resolved against
    the run's (:func:`resolve_sampling`). With `divergence_watch` each answer is remembered and
    each request checked against them (`gymrl.generation.server.divergence_watch`); when the
    watch stops divergences, a diverged request is answered without generating
    (:func:`withheld_answer`). With `route_store` (router replay) each generation asks the
    engine for its routed experts while the store captures, and the answer's routes are held
    there (`gymrl.generation.server.route_store`)."""

    engine: RequestScheduler
    chat_format: ChatFormat
    model_name: str
    honor_prompt_token_ids: bool
    default_max_tokens: int
    max_context_tokens: int
    request_timeout_s: float
    sampling_parity: SamplingParity | None
    divergence_watch: DivergenceWatch | None
    route_store: RouteStore | None = None

    def __post_init__(self) -> None:
        for name, value, minimum in (
            ("default_max_tokens", self.default_max_tokens, 1),
            ("max_context_tokens", self.max_context_tokens, 2),
        ):
            if value < minimum:
                raise ValueError(f"{name}={value} must be >= {minimum}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s={self.request_timeout_s} must be > 0 seconds")

    async def answer(
        self, body: PolicyServerRequest, render_worker: RenderWorker
    ) -> ChatCompletion:
        """The answer to `body`; rendering and parsing run on `render_worker` (off the event
        loop, one thread, so the tokenizer is only ever used from one thread, each call within
        its deadline). A refusal is an :class:`ApiError`."""
        check_model(body, self.model_name)
        sampling = resolve_sampling(body, self.sampling_parity)
        prompt, verdict = await render_worker.run(self.render, body)
        if self.withholds(verdict):
            return withheld_answer(prompt, self.model_name)
        output = await self.generate(self.generation_request(body, prompt, sampling))
        return await render_worker.run(self.respond, body, prompt, output)

    def render(self, body: PolicyServerRequest) -> tuple[PromptTokens, Verdict]:
        """The prompt's ids (:meth:`prompt_tokens`), and the divergence watch's verdict on them:
        `UNKNOWN` without a watch, and for a declared segment start
        (:attr:`PolicyServerRequest.starts_segment`), whose history was rewritten on purpose and
        is neither checked nor counted."""
        prompt = self.prompt_tokens(body)
        if self.divergence_watch is None or body.starts_segment:
            return prompt, Verdict.UNKNOWN
        return prompt, self.divergence_watch.check(body.messages, prompt.token_ids)

    def prompt_tokens(self, body: PolicyServerRequest) -> PromptTokens:
        """The prompt's ids with the model's chat template: after the request's
        `required_prefix_token_ids` when it names them, else with the ids sent back on earlier
        turns when honoured; what the template refuses is a 400 naming the field. `/tokenize`
        answers with these very ids."""
        try:
            if body.required_prefix_token_ids is not None:
                return build_prompt_after_required_prefix(
                    body.messages, body.tools, self.chat_format, body.required_prefix_token_ids
                )
            return build_prompt_token_ids(
                body.messages,
                body.tools,
                self.chat_format,
                honor_prompt_token_ids=self.honor_prompt_token_ids,
            )
        except ChatFormatError as error:
            raise ApiError(
                400, str(error), error_type="invalid_request_error", param=error.param
            ) from error

    async def tokenize(
        self, body: PolicyServerRequest, render_worker: RenderWorker
    ) -> TokenizeAnswer:
        """`POST /tokenize`: the ids a chat completion of `body` would generate from, rendered
        on `render_worker`, with the context limit; a prompt longer than the context is counted,
        not refused (vLLM's `/tokenize` does the same), so a client can measure it."""
        check_model(body, self.model_name)
        prompt = await render_worker.run(self.prompt_tokens, body)
        return TokenizeAnswer(
            tokens=prompt.token_ids,
            count=len(prompt.token_ids),
            max_model_len=self.max_context_tokens,
        )

    def withholds(self, verdict: Verdict) -> bool:
        """Whether a request with this verdict is answered without generating."""
        watch = self.divergence_watch
        return verdict is Verdict.DIVERGED and watch is not None and watch.stop

    def generation_request(
        self, body: PolicyServerRequest, prompt: PromptTokens, sampling: Sampling
    ) -> GenerationRequest:
        """What the engine generates: the prompt's ids, at `sampling`, up to the clamped
        :func:`max_new_tokens`, stopping at the end of the assistant turn."""
        return GenerationRequest(
            prompt_token_ids=prompt.token_ids,
            params=SamplingParams(
                max_new_tokens=max_new_tokens(
                    body, len(prompt.token_ids), self.default_max_tokens, self.max_context_tokens
                ),
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                stop_token_ids=self.chat_format.stop_token_ids,
                seed=body.seed,
            ),
            routes_from=(
                routes_from(prompt.reused_token_count)
                if self.route_store is not None and self.route_store.capturing
                else None
            ),
        )

    async def generate(self, request: GenerationRequest) -> GenerationOutput:
        """The engine's output within `request_timeout_s`; a failure is :func:`engine_error`'s
        answer."""
        try:
            return await await_generation(
                self.engine.submit(request), timeout_s=self.request_timeout_s
            )
        except Exception as error:
            raise engine_error(error) from error

    def respond(
        self, body: PolicyServerRequest, prompt: PromptTokens, output: GenerationOutput
    ) -> ChatCompletion:
        """The OpenAI answer to `output`, remembered by the divergence watch (if any) so that the
        next turn of the conversation can be checked against it."""
        answer = _build_response(body, prompt, output, self.chat_format, self.model_name)
        if self.route_store is not None and output.routed_experts is not None:
            self.route_store.put(prompt.token_ids + output.token_ids, output.routed_experts)
        if self.divergence_watch is not None:
            self.divergence_watch.remember(
                answer.choices[0].message, prompt.token_ids, output.token_ids
            )
        return answer


# ---------------------------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------------------------


_RETRY_LATER = {503: retry_after_header()}  # "not now", said with when to come back
# How long shutdown waits for a render in progress: the server's own close
# (GenerationServer: 50 s) must outlast it.
_RENDER_CLOSE_S = 5.0


def _error_response(status: int, message: str, error_type: str, param: str | None) -> JSONResponse:
    body = {"error": {"message": message, "type": error_type, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=_RETRY_LATER.get(status))


async def _on_api_error(_request: Request, error: ApiError) -> JSONResponse:
    return _error_response(error.status, error.message, error.error_type, error.param)


async def _on_http_error(_request: Request, error: HTTPException) -> JSONResponse:
    """FastAPI's own refusals (a body that is not JSON, an unknown route) in OpenAI's shape."""
    error_type = "invalid_request_error" if error.status_code < 500 else "server_error"
    param = "body" if error.status_code == 400 else None
    return _error_response(
        error.status_code, f"request {param or 'route'}: {error.detail}", error_type, param
    )


async def _on_invalid_request(_request: Request, error: RequestValidationError) -> JSONResponse:
    return _error_response(
        400, describe_validation_errors(error.errors()), "invalid_request_error", None
    )


def create_policy_server_app(
    engine: RequestScheduler,
    chat_format: ChatFormat,
    *,
    model_name: str,
    api_key: SecretStr | None,
    honor_prompt_token_ids: bool,
    default_max_tokens: int,
    max_context_tokens: int,
    request_timeout_s: float,
    request_bytes_per_context_token: int,
    render_timeout_s: float,
    sampling_parity: SamplingParity | None = None,
    divergence_watch: DivergenceWatch | None = None,
    route_store: RouteStore | None = None,
) -> FastAPI:
    """An OpenAI-compatible policy server over `engine` (see the module docstring): the routes,
    wired to :class:`ChatCompletions` (whose docstring says what `sampling_parity`,
    `divergence_watch` and `route_store` do). A chat request's body is bounded by the context
    (`max_context_tokens` x `request_bytes_per_context_token`, :mod:`.request_body`) and read
    within `request_timeout_s`; rendering and parsing run on one worker, each call within
    `render_timeout_s` (:mod:`.render_worker`).

    The app bounds its bodies itself, before reading them: serve it with lifespan on and
    without a buffering body limit in front
    (`nemo_gym_ext.http_server.serve_in_thread(app, max_body_bytes=None)`)."""
    completions = ChatCompletions(
        engine=engine,
        chat_format=chat_format,
        model_name=model_name,
        honor_prompt_token_ids=honor_prompt_token_ids,
        default_max_tokens=default_max_tokens,
        max_context_tokens=max_context_tokens,
        request_timeout_s=request_timeout_s,
        sampling_parity=sampling_parity,
        divergence_watch=divergence_watch,
        route_store=route_store,
    )
    body_bound = BodyBound(max_context_tokens, request_bytes_per_context_token)
    render_worker = RenderWorker(timeout_s=render_timeout_s)
    created = int(time.time())

    serving = threading.Event()  # between the lifespan's start and the start of its shutdown

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        serving.set()
        try:
            yield
        finally:
            serving.clear()
            if not render_worker.close(_RENDER_CLOSE_S):
                logger.warning(
                    "the policy server's render worker was still running a call %.0f s after "
                    "shutdown began; it is left to end on its own",
                    _RENDER_CLOSE_S,
                )

    dependencies = [] if api_key is None else [Depends(_bearer_check(api_key))]
    app = FastAPI(title=f"policy model server ({model_name})", lifespan=lifespan)
    app.exception_handler(ApiError)(_on_api_error)
    app.exception_handler(HTTPException)(_on_http_error)
    app.exception_handler(RequestValidationError)(_on_invalid_request)

    @app.get("/health")
    async def health() -> Response:
        """200 while requests are served, 503 otherwise (shutting down, or the engine stopped
        after a failed step, named): what vLLM's and SGLang's `GET /health` answer, so routers
        and readiness probes poll it without an API key."""
        failure = engine.failure()
        if failure is not None:
            raise ApiError(503, str(failure), error_type="service_unavailable_error")
        if serving.is_set():
            return Response(status_code=200)
        raise ApiError(
            503, "the policy server is shutting down", error_type="service_unavailable_error"
        )

    @app.get("/v1/models", response_model=ModelList, dependencies=dependencies)
    async def list_models() -> ModelList:
        card = ModelCard(
            id=model_name, created=created, owned_by=_OWNER, max_model_len=max_context_tokens
        )
        return ModelList(data=[card])

    @app.post("/v1/chat/completions", response_model=ChatCompletion, dependencies=dependencies)
    async def chat_completions(http_request: Request) -> Response:
        body = await body_bound.read(http_request, PolicyServerRequest, timeout_s=request_timeout_s)
        answer = await completions.answer(body, render_worker)
        return Response(content=answer.model_dump_json(), media_type="application/json")

    @app.post("/tokenize", response_model=TokenizeAnswer, dependencies=dependencies)
    async def tokenize(http_request: Request) -> Response:
        """vLLM's `/tokenize` (chat form), at the root as vLLM serves it: Gym's clients call
        `{base_url without /v1}/tokenize`. The body is a chat completion's, bounded alike."""
        body = await body_bound.read(http_request, PolicyServerRequest, timeout_s=request_timeout_s)
        answer = await completions.tokenize(body, render_worker)
        return Response(content=answer.model_dump_json(), media_type="application/json")

    return app


def _bearer_check(api_key: SecretStr):
    expected = f"Bearer {api_key.get_secret_value()}".encode()

    async def check(authorization: str | None = Header(default=None)) -> None:
        if authorization is None or not secrets.compare_digest(authorization.encode(), expected):
            raise ApiError(
                401,
                "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the "
                "key this server was started with",
                error_type="authentication_error",
            )

    return check


def _build_response(
    body: PolicyServerRequest,
    prompt: PromptTokens,
    output: GenerationOutput,
    chat_format: ChatFormat,
    model_name: str,
) -> ChatCompletion:
    parsed = chat_format.parse(output.token_ids)
    finish_reason = "tool_calls" if parsed.tool_calls else output.finish_reason
    message = ChatMessage(
        role="assistant",
        content=parsed.content,
        tool_calls=parsed.tool_calls or None,
        reasoning_content=parsed.reasoning_content,
        prompt_token_ids=prompt.token_ids,
        generation_token_ids=output.token_ids,
        generation_log_probs=output.logprobs,
        weight_version=output.weight_version,
    )
    logprobs = (
        ChoiceLogprobs(content=_token_logprobs(body, output, chat_format))
        if body.logprobs
        else None
    )
    completion_tokens = len(output.token_ids)
    return ChatCompletion(
        id=f"chatcmpl-{uuid.uuid4().hex}",
        object="chat.completion",
        created=int(time.time()),
        model=model_name,
        choices=[
            ChatChoice(index=0, finish_reason=finish_reason, message=message, logprobs=logprobs)
        ],
        usage=Usage(
            prompt_tokens=len(prompt.token_ids),
            completion_tokens=completion_tokens,
            total_tokens=len(prompt.token_ids) + completion_tokens,
        ),
    )


def withheld_answer(prompt: PromptTokens, model_name: str) -> ChatCompletion:
    """The answer to a request whose prompt diverged while the server stops divergences: no
    text, no tool calls, nothing generated, `finish_reason: "content_filter"` (OpenAI's reason
    for output the server withheld). Clients end the episode on it: an answer without tool
    calls is final for Gym's agents, and the built-in agent stops on this reason. The token
    bundle is kept (the diverged prompt, an empty generation), so the postprocessor classifies
    the divergence on the prompt the server saw and truncates the episode there, exactly where
    truncation would have cut it."""
    message = ChatMessage(
        role="assistant",
        content=None,
        prompt_token_ids=prompt.token_ids,
        generation_token_ids=[],
        generation_log_probs=[],
    )
    return ChatCompletion(
        id=f"chatcmpl-{uuid.uuid4().hex}",
        object="chat.completion",
        created=int(time.time()),
        model=model_name,
        choices=[ChatChoice(index=0, finish_reason=WITHHELD_FINISH_REASON, message=message)],
        usage=Usage(
            prompt_tokens=len(prompt.token_ids),
            completion_tokens=0,
            total_tokens=len(prompt.token_ids),
        ),
    )


def _token_logprobs(
    body: PolicyServerRequest, output: GenerationOutput, chat_format: ChatFormat
) -> list[TokenLogprob]:
    """OpenAI's per-token entries; `token_id:<id>` strings under `return_tokens_as_token_ids`."""
    tokens: Sequence[str]
    if body.return_tokens_as_token_ids:
        tokens = [f"token_id:{token_id}" for token_id in output.token_ids]
    else:
        tokens = chat_format.tokenizer.batch_decode([[token_id] for token_id in output.token_ids])
    return [
        TokenLogprob(token=token, logprob=logprob)
        for token, logprob in zip(tokens, output.logprobs, strict=True)
    ]

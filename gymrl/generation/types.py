"""The narrow interface every generation engine (torch on CPU, SGLang on GPUs) implements.

Engines are token-in / token-out: the policy model server renders chat messages to token ids and
the engine never sees text. Log-probabilities are those of the sampled tokens under the
temperature-scaled distribution, before top-p truncation, which is what the trainer recomputes
for the importance-sampling ratio.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. `stop_token_ids` end a generation (the stop token is kept)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None


@dataclass(frozen=True)
class GenerationRequest:
    prompt_token_ids: Sequence[int]
    params: SamplingParams


@dataclass(frozen=True)
class GenerationOutput:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    weight_version: int
    prompt_token_ids: list[int] = field(default_factory=list)


class GenerationEngine(Protocol):
    """What the model server and the training loop need from an engine."""

    @property
    def weight_version(self) -> int: ...

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        """Generate for a batch of requests, one output per request, in order."""
        ...

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace the weights in place (refit) and set the weight version."""
        ...


class EngineUnavailableError(RuntimeError):
    """The engine cannot take requests now (closed, or shutting down); the policy server answers
    503, which clients may retry."""


class UnsupportedRequestError(ValueError):
    """A request the engine cannot honour as asked (`param` names the request field): the
    policy server answers 400 naming it, which clients do not retry, instead of a 500 that an
    agent retries and charges to the rollout failure budget."""

    def __init__(self, message: str, *, param: str):
        super().__init__(message)
        self.param = param


class EngineFailedError(RuntimeError):
    """The engine stopped for good because one of its own steps failed (the cause is chained):
    every request after it fails the same way, so the policy server answers 500 and `GET
    /health` 503 with this message, and a run stops with it instead of charging each agent's
    failed episode to the rollout failure budget."""


@runtime_checkable
class RequestScheduler(Protocol):
    """An engine that schedules concurrent requests itself: the torch engine admits each new
    request into the rows already decoding, SGLang batches on its server.

    The policy server hands it each request alone as it arrives, so a long generation never
    holds back the answer to a short one, instead of gathering requests into batches that end
    with their slowest member.
    """

    def submit(self, request: GenerationRequest) -> Future[GenerationOutput]:
        """Start generating for `request`; cancelling the future abandons it."""
        ...

    def failure(self) -> EngineFailedError | None:
        """Why the engine stopped for good, or None while it serves (or was closed normally)."""
        ...

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

import numpy as np
import torch

from gymrl.config.schema.policy import EXPERT_COUNT_KEYS

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
class RouteLayout:
    """What one position's routes hold for an MoE model: `num_layers` x `experts_per_token`
    expert ids below `num_experts`, stored as the narrowest unsigned type that also leaves room
    for :attr:`missing`, the id of a position without routes (the trainer's live router decides
    it)."""

    num_layers: int
    experts_per_token: int
    num_experts: int

    @classmethod
    def of_model_config(cls, config: Mapping[str, object]) -> RouteLayout:
        """From a Hugging Face `config.json` (the expert count is Qwen3-MoE's `num_experts`, or
        `num_local_experts` as newer transformers write it, or DeepSeek's `n_routed_experts`); a
        dense model's config is an error naming the missing keys."""
        named = [config[key] for key in EXPERT_COUNT_KEYS if key in config]
        experts = named[0] if named else None
        layers, per_token = config.get("num_hidden_layers"), config.get("num_experts_per_tok")
        if not (
            isinstance(layers, int)
            and isinstance(per_token, int)
            and isinstance(experts, int)
            and min(layers, per_token, experts) > 0
        ):
            raise ValueError(
                "router replay needs an MoE model: its config.json must give num_hidden_layers, "
                f"num_experts_per_tok and num_experts (got {layers!r}, {per_token!r}, {experts!r})"
            )
        return cls(num_layers=layers, experts_per_token=per_token, num_experts=experts)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint8 if self.num_experts < 255 else np.uint16)

    @property
    def missing(self) -> int:
        return int(np.iinfo(self.dtype).max)

    @property
    def bytes_per_position(self) -> int:
        return self.num_layers * self.experts_per_token * self.dtype.itemsize

    def narrowed(self, rows: np.ndarray) -> np.ndarray:
        """`rows` (any integer type, `[positions, layers, top-k]`) in :attr:`dtype`, checked:
        a shape or an expert id this layout cannot hold is an error, not a silent wrap."""
        expected = (self.num_layers, self.experts_per_token)
        if rows.ndim != 3 or rows.shape[1:] != expected:
            raise ValueError(
                f"routes of shape {list(rows.shape)}, expected [positions, {expected[0]}, "
                f"{expected[1]}] (num_hidden_layers, num_experts_per_tok)"
            )
        if rows.size and (rows.min() < 0 or rows.max() >= self.num_experts):
            raise ValueError(
                f"routes name experts {int(rows.min())}..{int(rows.max())}, outside "
                f"0..{self.num_experts - 1}"
            )
        return rows.astype(self.dtype)


@dataclass(frozen=True)
class RoutedExperts:
    """The experts an MoE engine routed a run of positions of one sequence to (router replay).

    `rows[i]` holds, for position `start + i` of the sequence (prompt and generation), the
    expert ids each layer chose: `[positions, layers, experts per token]`, as small an unsigned
    integer type as the expert count allows (uint8 up to 255 experts). An engine reports every
    position it ran through the model: all but the last sampled token, which no forward saw.
    """

    start: int
    rows: np.ndarray

    def __post_init__(self) -> None:
        if self.start < 0 or self.rows.ndim != 3:
            raise ValueError(
                f"routed experts need start >= 0 and rows [positions, layers, top-k], got "
                f"start={self.start}, rows of shape {list(self.rows.shape)}"
            )

    @property
    def end(self) -> int:
        """One past the last position the rows cover."""
        return self.start + len(self.rows)


@dataclass(frozen=True)
class GenerationRequest:
    """`routes_from`: with router replay, the first position of the sequence (prompt plus
    generation) whose routed experts the answer must carry; None asks for none."""

    prompt_token_ids: Sequence[int]
    params: SamplingParams
    routes_from: int | None = None


@dataclass(frozen=True)
class GenerationOutput:
    """`routed_experts`: the routes asked for by the request's `routes_from` (None when not
    asked, or when the engine's answer could not be placed; see the engine)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    weight_version: int
    prompt_token_ids: list[int] = field(default_factory=list)
    routed_experts: RoutedExperts | None = None


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

"""Rollout collection: post rows to Gym agents, postprocess each result, group them for GRPO.

One GRPO group is `n` episodes of the same row (same agent, same task). Each episode is one
`POST {agent_url}/run` with a deadline. Transport failures (connection errors, timeouts, 5xx,
429) are retried a bounded number of times, after an exponential back-off with jitter that is
never shorter than the agent's `Retry-After` (:mod:`nemo_gym_ext.retry`); an answer that cannot
get better on retry (over `max_result_bytes`, not JSON, not an object) fails its episode at once.
What still fails is reported with its cause so the caller can count it against the run's failure
budget. A result that cannot be trained on (a contiguity error with truncation off, a malformed
result with `on_malformed_result=raise`) is not retried either: it is a property of the pipeline,
not a transient fault, and the run should stop on it.

Rows go out and results come in as JSON through orjson; results are parsed without building the
ints of repeated prompt prefixes (:mod:`nemo_gym_ext.result_json`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from nemo_gym_ext.config import NemoGymPostprocessConfig
from nemo_gym_ext.json_body import JSON_HEADERS, dumps_json
from nemo_gym_ext.keep_alive import CLIENT_KEEPALIVE_EXPIRY_S
from nemo_gym_ext.overlong import PromptTooLongError
from nemo_gym_ext.postprocess import (
    Decode,
    PostprocessedEpisode,
    postprocess_gym_result,
    row_id_of,
)
from nemo_gym_ext.result_json import loads_result
from nemo_gym_ext.retry import backoff_s, retry_after_s
from nemo_gym_ext.wire import agent_name_of

log = logging.getLogger(__name__)

_SHORTEN = (
    "Shorten the row's prompt (system prompt, tools and input all count) or raise the context"
)


class UnknownAgentError(ValueError):
    """A row names an agent that no shard serves."""


class RolloutBudgetExceeded(RuntimeError):
    """More episodes failed (after retries) than env.rollout.failure_budget and
    env.rollout.failure_rate allow."""


class FailureBudget:
    """Counts episodes that failed after their retries; once they are more than `limit` plus
    `rate` times the episodes run so far (those that came back and those that failed), the run
    stops with the last cause, instead of quietly training on ever fewer episodes. A budget per
    run alone would not scale with its length; the rate lets a long run tolerate a share.

    With `charge` false (`env.rollout.on_episode_error=reward`: the user counts an environment's
    failure as the model's, e.g. a server that answers 500 to a reply without a parsable move)
    failures are counted and never stop the run."""

    def __init__(self, limit: int, *, rate: float = 0.0, charge: bool = True):
        self.limit = limit
        self.rate = rate
        self.charge = charge
        self.count = 0
        self.episodes = 0
        self.last_cause = ""

    def record(self, failures: list[str], *, episodes: int) -> None:
        """`failures` (their causes) of a group of `episodes` episodes, failed ones included."""
        self.episodes += episodes
        if not failures:
            return
        self.count += len(failures)
        self.last_cause = failures[-1]
        allowed = self.limit + self.rate * self.episodes
        if self.charge and self.count > allowed:
            raise RolloutBudgetExceeded(
                f"{self.count} of {self.episodes} episodes failed after retries, more than "
                f"env.rollout.failure_budget={self.limit} + env.rollout.failure_rate={self.rate:g}"
                f" x {self.episodes} episodes = {allowed:g}; last cause: {self.last_cause}. If "
                "these failures are the model's (an environment refusing its replies), "
                "env.rollout.on_episode_error=reward counts them as a reward instead"
            )


@dataclass
class GroupOutcome:
    """What came back for one row: postprocessed episodes, and the causes of those that failed;
    `prompt_refused` says why the policy server refused the row's prompt (then no episode)."""

    row_id: str
    agent: str
    episodes: list[PostprocessedEpisode] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    retries: int = 0
    prompt_refused: str = ""
    timeouts: int = 0  # attempts that ran out of env.rollout.run_timeout_s (retried or failed)


@dataclass(frozen=True)
class PromptSize:
    """How a collector measures a row's prompt when the policy server refuses it: `count` gives
    its tokens as the server renders them, `context_tokens` is the server's context."""

    count: Callable[[Mapping[str, Any]], int]
    context_tokens: int


class UnusableAnswerError(ValueError):
    """An agent's /run answer that no retry can fix: too large, not JSON, not an object."""


class ResultTooLargeError(UnusableAnswerError):
    """An agent's /run answer exceeded `max_result_bytes`."""


@dataclass(frozen=True)
class RolloutSettings:
    max_concurrent_rollouts: int
    run_timeout_s: float
    max_retries: int
    max_result_bytes: int
    retry_backoff_s: float
    retry_backoff_max_s: float
    # The policy server withholds diverged answers (generation.server.stop_on_divergence).
    server_stops_divergences: bool


class RolloutCollector:
    """Runs GRPO groups against the agents of one Gym shard."""

    def __init__(
        self,
        agent_urls: Mapping[str, str],
        postprocess: NemoGymPostprocessConfig,
        settings: RolloutSettings,
        *,
        vocab_size: int | None = None,
        decode: Decode | None = None,
        prompt_size: PromptSize | None = None,
    ):
        """`prompt_size`: measures a refused prompt for the message (without it, the message
        names the row and agent only)."""
        self._prompt_size = prompt_size
        self._agent_urls = dict(agent_urls)
        self._postprocess = postprocess
        self._settings = settings
        self._vocab_size = vocab_size
        self._decode = decode
        self._slots = asyncio.Semaphore(settings.max_concurrent_rollouts)
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.run_timeout_s, connect=10.0),
            limits=httpx.Limits(
                max_connections=settings.max_concurrent_rollouts,
                keepalive_expiry=CLIENT_KEEPALIVE_EXPIRY_S,
            ),
        )

    @property
    def agents(self) -> list[str]:
        return sorted(self._agent_urls)

    async def run_group(self, row: Mapping[str, Any], num_episodes: int) -> GroupOutcome:
        agent = agent_name_of(row)
        if agent not in self._agent_urls:
            raise UnknownAgentError(
                f"row {row_id_of(row)!r} names agent {agent!r}, which this shard does not serve; "
                f"served: {self.agents}. Fix the row's agent_ref.name or env.nemo_gym.agents."
            )
        outcome = GroupOutcome(row_id=row_id_of(row), agent=agent)
        outcome.prompt_refused = self._beyond_context(row, outcome)
        if outcome.prompt_refused:
            return outcome
        results = await asyncio.gather(
            *(self._run_episode(row, agent, outcome) for _ in range(num_episodes))
        )
        if not outcome.prompt_refused:  # a refused prompt leaves nothing to train on
            outcome.episodes = [result for result in results if result is not None]
        return outcome

    async def _run_episode(
        self, row: Mapping[str, Any], agent: str, outcome: GroupOutcome
    ) -> PostprocessedEpisode | None:
        url = f"{self._agent_urls[agent]}/run"
        settings = self._settings
        cause, retry_after = "", None
        for attempt in range(settings.max_retries + 1):
            if attempt:
                outcome.retries += 1
                # Waiting holds no slot: other episodes run meanwhile.
                await asyncio.sleep(
                    backoff_s(
                        attempt,
                        base_s=settings.retry_backoff_s,
                        max_s=settings.retry_backoff_max_s,
                        retry_after=retry_after,
                    )
                )
            try:
                async with self._slots:
                    result = await self._post(url, row)
            except UnusableAnswerError as error:
                outcome.failures.append(
                    f"agent {agent!r} row {outcome.row_id!r} failed, not retried (a retry cannot "
                    f"fix it): {type(error).__name__}: {error}"
                )
                return None
            except (httpx.TransportError, httpx.HTTPStatusError, TimeoutError) as error:
                outcome.timeouts += isinstance(error, TimeoutError | httpx.TimeoutException)
                cause = f"{type(error).__name__}: {error}"
                response = getattr(error, "response", None)
                retry_after = None if response is None else retry_after_s(response.headers)
                continue
            # Contiguity and malformed-result errors propagate: retrying would hide them.
            try:
                return postprocess_gym_result(
                    row,
                    result,
                    self._postprocess,
                    vocab_size=self._vocab_size,
                    decode=self._decode,
                    server_stops_divergences=settings.server_stops_divergences,
                )
            except PromptTooLongError as error:  # never retried: the prompt stays as long
                if not outcome.prompt_refused:
                    outcome.prompt_refused = self._refusal(error, row)
                return None
        outcome.failures.append(
            f"agent {agent!r} row {outcome.row_id!r} failed after "
            f"{settings.max_retries + 1} attempts: {cause}"
        )
        return None

    def _beyond_context(self, row: Mapping[str, Any], outcome: GroupOutcome) -> str:
        """Why the policy server would refuse the row's prompt, measured before sending it (""
        when it fits or cannot be measured: the server then decides). Agents do not all report
        a refusal alike (Gym's answer an empty `length` turn, or fail when the environment
        cannot verify an empty answer), so a prompt that cannot fit is not sent at all."""
        if self._prompt_size is None:
            return ""
        try:
            tokens = self._prompt_size.count(row)
        except Exception as error:  # the policy server renders it, and says what is wrong
            log.warning(
                f"row {outcome.row_id!r} (agent {outcome.agent!r}): its prompt could not be "
                f"measured before sending ({type(error).__name__}: {error}); sent unmeasured, "
                "the policy server decides"
            )
            return ""
        context = self._prompt_size.context_tokens
        if tokens < context:
            return ""
        return (
            f"row {outcome.row_id!r} (agent {outcome.agent!r}): its prompt is {tokens} tokens, "
            f"no fewer than the policy server's context of {context} tokens "
            "(policy.max_total_sequence_length), which the policy server refuses (400 'maximum "
            f"context length'), so it was not sent. {_SHORTEN}"
        )

    def _refusal(self, error: PromptTooLongError, row: Mapping[str, Any]) -> str:
        """The refusal's message with the prompt's size against the context, where measured."""
        if self._prompt_size is None:
            return str(error)
        try:
            size = f"{self._prompt_size.count(row)} prompt tokens"
        except Exception as failure:  # the message must still come out
            size = f"prompt tokens not counted ({type(failure).__name__}: {failure})"
        return (
            f"{error}: {size} against a context of {self._prompt_size.context_tokens} tokens "
            f"(policy.max_total_sequence_length). {_SHORTEN}"
        )

    async def _post(self, url: str, row: Mapping[str, Any]) -> dict[str, Any]:
        deadline_s = self._settings.run_timeout_s
        try:
            async with (
                asyncio.timeout(deadline_s),
                self._client.stream(
                    "POST", url, content=dumps_json(dict(row)), headers=JSON_HEADERS
                ) as response,
            ):
                body = await self._read_capped(url, response)
        except TimeoutError as error:  # asyncio's says nothing of what timed out
            raise TimeoutError(
                f"agent at {url} did not finish the episode within "
                f"env.rollout.run_timeout_s={deadline_s:g} s"
            ) from error
        if response.status_code >= 400:
            detail = body[:500].decode(errors="replace")
            if response.status_code < 500 and response.status_code != 429:
                raise RuntimeError(
                    f"agent at {url} rejected the row ({response.status_code}): {detail}"
                )
            # The agent's own words name what failed behind it (e.g. the policy server).
            raise httpx.HTTPStatusError(
                f"agent at {url} answered {response.status_code}: {detail}",
                request=response.request,
                response=response,
            )
        try:
            result = loads_result(body)
        except ValueError as error:
            raise UnusableAnswerError(
                f"agent at {url} answered what is not JSON: {type(error).__name__}: {error}"
            ) from error
        if not isinstance(result, dict):
            raise UnusableAnswerError(
                f"agent at {url} returned {type(result).__name__}, not an object"
            )
        return result

    async def _read_capped(self, url: str, response: httpx.Response) -> bytes:
        """The body, refused past `max_result_bytes` (declared or counted) without reading on."""
        limit = self._settings.max_result_bytes
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise ResultTooLargeError(
                f"agent at {url} answered {declared} bytes, more than "
                f"env.rollout.max_result_bytes={limit}"
            )
        chunks, size = [], 0
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > limit:
                raise ResultTooLargeError(
                    f"agent at {url} answered more than env.rollout.max_result_bytes={limit} bytes"
                )
            chunks.append(chunk)
        return b"".join(chunks)

    async def aclose(self) -> None:
        await self._client.aclose()

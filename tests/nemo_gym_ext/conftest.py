"""Builders of NeMo-Gym episodes for the postprocessor and metrics tests.

An episode is built the way a Gym agent produces one: the model server keeps a token `history`;
each model call's prompt is the history plus a new delta (tool output, user text, template
tokens), and its generation is appended to the history. Between model calls the output holds
items without token fields (reasoning, function_call_output, user messages), and optionally
retried model calls with an empty generation whose prompt is garbage, to prove they are skipped.

A divergence is injected the way re-rendering produces one: at a chosen trainable turn the
server's history is corrupted before the turn's prompt is formed, and every later turn continues
from the corrupted history (so later turns are contiguous with the divergent one, and only the
first divergent turn reveals the break). The builder re-checks its own output with a plain
`seen` walk, so a test never runs on an episode that is not what it claims to be.

conftest modules are not importable from test files, so the builders are handed out as
session-scoped fixtures (session scope keeps them usable from hypothesis tests).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import pytest

# SmolLM2's vocabulary size: realistic ids, and the bound passed as `vocab_size` in the tests.
VOCAB_SIZE = 49152

DivergenceKind = Literal["substitute", "insert", "drop_generation"]


@dataclass(frozen=True)
class Divergence:
    """Corrupt the server's history before trainable turn `turn` (>= 1).

    `substitute`: the token at `position` (taken modulo the history length) is re-tokenised to
    another id. `insert`: an extra token appears at `position`. `drop_generation`: the previous
    turn's generation never reaches the prompt (a retried model call).
    """

    turn: int
    kind: DivergenceKind = "substitute"
    position: int = 0


@dataclass(frozen=True)
class Episode:
    """A Gym row and result, plus the token fields of every trainable turn, in order."""

    row: dict[str, Any]
    result: dict[str, Any]
    prompts: list[list[int]]
    generations: list[list[int]]
    logprobs: list[list[float]]
    item_indices: list[int]
    divergent_turn: int | None
    divergent_position: int | None

    def seen_before(self, turn: int) -> list[int]:
        """Everything a contiguous episode has seen before `turn`: prompt + generation of turn-1."""
        if turn == 0:
            return []
        return self.prompts[turn - 1] + self.generations[turn - 1]

    def delta(self, turn: int) -> list[int]:
        return self.prompts[turn][len(self.seen_before(turn)) :]


def logprobs_for(generation: Sequence[int]) -> list[float]:
    """Deterministic, finite, non-positive log-probabilities that differ from token to token."""
    return [-((token % 13) + 1) / 16 for token in generation]


def first_divergence(prompts: Sequence[list[int]], generations: Sequence[list[int]]):
    """(turn, position) of the first non-contiguous turn by a plain `seen` walk, or (None, None).

    The definition of contiguity, written the obvious way, used to check the builder's output.
    """
    seen: list[int] = []
    for turn, (prompt, generation) in enumerate(zip(prompts, generations, strict=True)):
        if prompt[: len(seen)] != seen:
            position = next(
                (i for i, (a, b) in enumerate(zip(prompt, seen, strict=False)) if a != b),
                min(len(prompt), len(seen)),
            )
            return turn, position
        seen.extend(prompt[len(seen) :])
        seen.extend(generation)
    return None, None


def build_episode(
    turns: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    divergence: Divergence | None = None,
    agent: str = "swe_agent",
    row_id: str = "task-0",
    reward: Any = 1.0,
    non_token_items: bool = True,
    empty_generation_after: Collection[int] = (),
    result_fields: Mapping[str, Any] | None = None,
) -> Episode:
    """Build an episode from `(delta, generation)` pairs, one per trainable turn.

    `empty_generation_after` lists trainable turns after which a retried model call with an
    empty generation (and a prompt that matches nothing) is inserted. `result_fields` are added
    to the result's top level (e.g. `overlong`, stale flags, verifier fields).
    """
    if not turns or not turns[0][0]:
        raise ValueError("the first turn needs a non-empty prompt delta")
    if not all(generation for _, generation in turns):
        raise ValueError("every trainable turn needs a non-empty generation")
    if divergence is not None and not 1 <= divergence.turn < len(turns):
        raise ValueError(f"divergence turn {divergence.turn} is outside [1, {len(turns)})")
    row = {
        "id": row_id,
        "agent_ref": {"type": "responses_api_agents", "name": agent},
        "responses_create_params": {
            "input": [{"role": "user", "content": "Fix the failing test."}],
            "tools": [{"type": "function", "name": "bash"}],
            "temperature": 1.0,
        },
    }
    output: list[dict[str, Any]] = []
    history: list[int] = []
    prompts, generations, logprobs, item_indices = [], [], [], []
    for turn, (delta, generation) in enumerate(turns):
        if divergence is not None and turn == divergence.turn:
            history = _corrupt(history, generations[-1], divergence)
        if non_token_items and turn > 0:
            output.append(
                {"type": "function_call_output", "call_id": f"call-{turn - 1}", "output": "ok"}
            )
            if turn % 3 == 0:
                output.append({"type": "message", "role": "user", "content": "keep going"})
        prompt = history + list(delta)
        generation = list(generation)
        if non_token_items:
            output.append({"type": "reasoning", "summary": [{"type": "summary_text", "text": "."}]})
        item_indices.append(len(output))
        output.append(
            {
                "type": "function_call",
                "call_id": f"call-{turn}",
                "name": "bash",
                "arguments": "{}",
                "prompt_token_ids": list(prompt),
                "generation_token_ids": list(generation),
                "generation_log_probs": logprobs_for(generation),
            }
        )
        if turn in empty_generation_after:
            output.append(
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [],
                    "prompt_token_ids": [(token + 1) % VOCAB_SIZE for token in prompt[::-1]],
                    "generation_token_ids": [],
                    "generation_log_probs": [],
                }
            )
        prompts.append(prompt)
        generations.append(generation)
        logprobs.append(logprobs_for(generation))
        history = prompt + generation
    divergent_turn, divergent_position = first_divergence(prompts, generations)
    requested = None if divergence is None else divergence.turn
    if divergent_turn != requested:
        raise ValueError(
            f"builder asked for a divergence at turn {requested} but the episode diverges at "
            f"turn {divergent_turn}; choose other tokens"
        )
    result = copy.deepcopy(row)
    result["response"] = {"id": f"resp-{row_id}", "output": output}
    result["reward"] = reward
    result.update(result_fields or {})
    return Episode(
        row,
        result,
        prompts,
        generations,
        logprobs,
        item_indices,
        divergent_turn,
        divergent_position,
    )


def _corrupt(history: list[int], previous_generation: list[int], divergence: Divergence):
    if divergence.kind == "drop_generation":
        return history[: len(history) - len(previous_generation)]
    position = divergence.position % len(history)
    replacement = (history[position] + 1) % VOCAB_SIZE
    if divergence.kind == "substitute":
        return [*history[:position], replacement, *history[position + 1 :]]
    return [*history[:position], replacement, *history[position:]]


def random_turns(
    seed: int, count: int, *, delta_length: int = 6, generation_length: int = 4
) -> list[tuple[list[int], list[int]]]:
    """`count` (delta, generation) pairs of random ids in the SmolLM2 vocabulary."""
    rng = random.Random(seed)

    def ids(length: int) -> list[int]:
        return [rng.randrange(VOCAB_SIZE) for _ in range(length)]

    return [(ids(delta_length), ids(generation_length)) for _ in range(count)]


@pytest.fixture(scope="session")
def episode_builder():
    """`build_episode(turns, *, divergence=..., ...) -> Episode` (see this module)."""
    return build_episode


@pytest.fixture(scope="session")
def divergence_at():
    """`Divergence(turn, kind="substitute", position=0)`: where and how an episode breaks."""
    return Divergence


@pytest.fixture(scope="session")
def turn_maker():
    """`random_turns(seed, count, *, delta_length=6, generation_length=4)`."""
    return random_turns

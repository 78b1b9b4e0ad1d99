"""Guess the number: find a secret integer in [low, high] from higher/lower hints.

A genuinely multi-turn task: the environment answers every reply until the number is found or the
agent's `max_turns` runs out. A `guess(number)` tool call is a guess; so is a reply without a tool
call that contains an integer (its last integer counts); a reply with neither gets a user message
asking for a guess. Ranges hold 8 to 16 numbers and start anywhere in 1-100, so there are
thousands of distinct tasks (held-out validation rows need tasks no training row has). A model
that follows the hints (binary search) always wins within 4 guesses in a range of at most 16.

Every row's input shows one won game before the task (`EnvironmentSpec.example`): guess tool
calls halving a range that no sampled task overlaps. Without it greedy SmolLM2-135M-Instruct
copied the tool's JSON schema into every reply and made no guess (mean reward 0.017 on 8
held-out rows); with it, it calls the tool every turn and earns 0.388 (s.e. 0.035) on 128
(benchmarks/README.md).

Reward: 1.0 if the number was found. Otherwise partial credit for the search done: half the share
of the wrong candidates that the hints received have ruled out (the secret's consistent interval
shrinking from the whole range), so a guess only pays by the information it bought; a reply
without a guess, or a guess outside the range, rules out nothing. `num_guesses` and
`candidates_left` (numbers still consistent with the hints, the secret included) are reported as
verifier fields.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator

from nemo_gym_ext.envs.resources import (
    EnvironmentSpec,
    SampledTask,
    Tool,
    ToolReply,
    UserReply,
    VerifierFields,
)

# Range sizes and starts of sampled tasks.
MIN_SIZE, MAX_SIZE = 8, 16
MAX_LOW = 100
PARTIAL_CREDIT = 0.5  # the most a search that did not find the number earns
SYSTEM_PROMPT = (
    "You are playing a number guessing game. Guess with the guess tool, or reply with just a "
    "number. After each guess you are told whether the secret number is higher or lower."
)
# Integers of at most 12 digits, not part of a longer run of digits: a 5000-digit "guess" is not
# an integer anyone meant, and int() of it would be slow or refused.
_INTEGER = re.compile(r"(?<!\d)-?\d{1,12}(?!\d)")


class GuessTask(BaseModel):
    """Task fields of a guess_number row."""

    model_config = ConfigDict(extra="ignore")

    secret: int = Field(description="The number to find.")
    low: int = Field(description="The secret lies in [low, high].")
    high: int = Field(description="The secret lies in [low, high].")

    @model_validator(mode="after")
    def _secret_in_range(self) -> GuessTask:
        if not self.low <= self.secret <= self.high:
            raise ValueError(f"secret {self.secret} is outside [{self.low}, {self.high}]")
        return self


@dataclass
class GuessState:
    secret: int
    low: int
    high: int
    num_guesses: int = 0
    found: bool = False
    # The interval still consistent with the hints given (it always holds the secret).
    consistent_low: int = 0
    consistent_high: int = 0

    def __post_init__(self) -> None:
        self.consistent_low, self.consistent_high = self.low, self.high

    def judge(self, number: int) -> str:
        """Count a guess and say 'higher', 'lower' or 'correct' (or why it is out of range)."""
        self.num_guesses += 1
        if not self.low <= number <= self.high:
            return f"{number} is out of range: the number is between {self.low} and {self.high}"
        if number < self.secret:
            self.consistent_low = max(self.consistent_low, number + 1)
            return "higher"
        if number > self.secret:
            self.consistent_high = min(self.consistent_high, number - 1)
            return "lower"
        self.found = True
        self.consistent_low = self.consistent_high = number
        return "correct"

    @property
    def candidates_left(self) -> int:
        return self.consistent_high - self.consistent_low + 1

    def reward(self) -> float:
        if self.found:
            return 1.0
        wrong_at_start = self.high - self.low  # every number of the range but the secret
        ruled_out = wrong_at_start - (self.candidates_left - 1)
        return PARTIAL_CREDIT * ruled_out / wrong_at_start


class GuessArguments(BaseModel):
    model_config = ConfigDict(extra="forbid")

    number: int = Field(description="Your guess, an integer.")


def _guess(state: GuessState, arguments: GuessArguments) -> ToolReply:
    return ToolReply(state.judge(arguments.number), done=state.found)


def _reply_to_text(state: GuessState, text: str) -> UserReply:
    integers = _INTEGER.findall(text)
    if not integers:
        return UserReply(
            f"Please guess a number between {state.low} and {state.high}: call the guess tool or "
            "reply with just the number.",
            done=False,
        )
    verdict = state.judge(int(integers[-1]))
    if state.found:
        return UserReply(content=None, done=True)
    return UserReply(f"{integers[-1]}: {verdict}. Guess again.", done=False)


def _verify(state: GuessState, output: list[dict]) -> VerifierFields:
    return {
        "reward": state.reward(),
        "num_guesses": state.num_guesses,
        "candidates_left": state.candidates_left,
    }


def _prompt(low: int, high: int) -> str:
    return (
        f"I am thinking of a secret integer between {low} and {high}. Find it: I will answer "
        "higher, lower or correct to each guess."
    )


def _sample_task(rng: random.Random) -> SampledTask:
    low = rng.randint(1, MAX_LOW)
    high = low + rng.randint(MIN_SIZE, MAX_SIZE) - 1
    secret = rng.randint(low, high)
    return SampledTask(
        prompt=_prompt(low, high), fields={"secret": secret, "low": low, "high": high}
    )


def _example_game(low: int, high: int, secret: int) -> tuple[dict, ...]:
    """A game of [low, high] won by halving the range with guess tool calls, as input items."""
    items: list[dict] = [{"role": "user", "content": _prompt(low, high)}]
    state = GuessState(secret=secret, low=low, high=high)
    while not state.found:
        guess = (state.consistent_low + state.consistent_high) // 2
        call_id = f"example_{state.num_guesses}"
        arguments = json.dumps({"number": guess})
        items.append(
            {"type": "function_call", "call_id": call_id, "name": "guess", "arguments": arguments}
        )
        items.append(
            {"type": "function_call_output", "call_id": call_id, "output": state.judge(guess)}
        )
    return tuple(items)


GUESS_NUMBER = EnvironmentSpec[GuessState](
    name="guess_number",
    system_prompt=SYSTEM_PROMPT,
    task=GuessTask,
    start=lambda task: GuessState(secret=task.secret, low=task.low, high=task.high),
    tools=(
        Tool(
            name="guess",
            description="Guess the secret number; answers higher, lower or correct.",
            arguments=GuessArguments,
            call=_guess,
        ),
    ),
    reply_to_text=_reply_to_text,
    verify=_verify,
    sample_task=_sample_task,
    # Outside the sampled ranges (lows of 1-100), so copying its guesses earns nothing.
    example=_example_game(low=150, high=161, secret=156),
)

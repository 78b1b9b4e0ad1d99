"""Guess the number: find a secret integer in [1, max_number] from higher/lower hints.

A genuinely multi-turn task that an untrained model can still win: the environment answers every
reply until the number is found or the agent's `max_turns` runs out. A `guess(number)` tool call
is a guess; so is a reply without a tool call that contains an integer (its last integer counts);
a reply with neither gets a user message asking for a guess. Even random guessing finds one of 8
numbers within 8 turns about two times in three, so GRPO has reward variance from the start, and
a model that follows the hints (binary search) wins in at most 4 guesses.

Reward: 1.0 if the number was found, else 0.0 (not scaled by the number of guesses: the turn
limit already prices slowness). `num_guesses` is reported as a verifier field.
"""

from __future__ import annotations

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

MAX_NUMBER = 8
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

    secret: int = Field(ge=1, description="The number to find.")
    max_number: int = Field(ge=1, description="The secret lies in [1, max_number].")

    @model_validator(mode="after")
    def _secret_in_range(self) -> GuessTask:
        if self.secret > self.max_number:
            raise ValueError(f"secret {self.secret} is above max_number {self.max_number}")
        return self


@dataclass
class GuessState:
    secret: int
    max_number: int
    num_guesses: int = 0
    found: bool = False

    def judge(self, number: int) -> str:
        """Count a guess and say 'higher', 'lower' or 'correct' (or why it is out of range)."""
        self.num_guesses += 1
        if not 1 <= number <= self.max_number:
            return f"{number} is out of range: the number is between 1 and {self.max_number}"
        if number < self.secret:
            return "higher"
        if number > self.secret:
            return "lower"
        self.found = True
        return "correct"


class GuessArguments(BaseModel):
    model_config = ConfigDict(extra="forbid")

    number: int = Field(description="Your guess, an integer.")


def _guess(state: GuessState, arguments: GuessArguments) -> ToolReply:
    return ToolReply(state.judge(arguments.number), done=state.found)


def _reply_to_text(state: GuessState, text: str) -> UserReply:
    integers = _INTEGER.findall(text)
    if not integers:
        return UserReply(
            f"Please guess a number between 1 and {state.max_number}: call the guess tool or "
            "reply with just the number.",
            done=False,
        )
    verdict = state.judge(int(integers[-1]))
    if state.found:
        return UserReply(content=None, done=True)
    return UserReply(f"{integers[-1]}: {verdict}. Guess again.", done=False)


def _verify(state: GuessState, output: list[dict]) -> VerifierFields:
    return {"reward": 1.0 if state.found else 0.0, "num_guesses": state.num_guesses}


def _sample_task(rng: random.Random) -> SampledTask:
    secret = rng.randint(1, MAX_NUMBER)
    prompt = (
        f"I am thinking of a secret integer between 1 and {MAX_NUMBER}. Guess it! I will answer "
        "higher, lower or correct."
    )
    return SampledTask(prompt=prompt, fields={"secret": secret, "max_number": MAX_NUMBER})


GUESS_NUMBER = EnvironmentSpec[GuessState](
    name="guess_number",
    system_prompt=SYSTEM_PROMPT,
    task=GuessTask,
    start=lambda task: GuessState(secret=task.secret, max_number=task.max_number),
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
)

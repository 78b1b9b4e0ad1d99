"""Calculator: small arithmetic word problems, with a `calculator(expression)` tool.

The problems are one- or two-step sums, differences and products of small integers with
non-negative answers. The model may call the calculator (evaluated by the safe parser in
:mod:`nemo_gym_ext.envs.tools`) any number of times; the episode ends when it replies without a
tool call.

Every row's input shows one solved problem first (`EnvironmentSpec.example`): a calculator call,
its result, and the reply "Answer: <result>". With that and a system prompt that asks for the
tool, greedy SmolLM2-135M-Instruct calls the calculator on about half the problems; with an
example whose final reply restated the sum ("347 + 258 = 605"), it copied that reply's shape and
did the arithmetic in its head, wrongly more often than not (benchmarks/README.md).

Reward: 1.0 when the final answer is the expected number, else 0.0. The final answer is the
number after the last "answer" in the final assistant text (the text after the last tool
output; "Answer: 42", "the answer is 42"), or, without one, the last number of that text. Only
that one number counts: a reply that lists several candidates, or restates the question's
numbers after the result, is not credited for containing the right one somewhere. No partial
credit: a wrong number is no closer to right for being near it. `answered` (the final text holds
a number at all) is reported as a verifier field, not rewarded.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from nemo_gym_ext.envs.resources import (
    EnvironmentSpec,
    SampledTask,
    Tool,
    ToolReply,
    UserReply,
    VerifierFields,
)
from nemo_gym_ext.envs.tools import ExpressionError, evaluate_expression, format_number
from nemo_gym_ext.wire import final_assistant_text

SYSTEM_PROMPT = (
    "You are a math assistant. Do not compute in your head: first call the calculator tool "
    "with the arithmetic expression, then reply 'Answer: <number>' with its result."
)
_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fay")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_AFTER_ANSWER = re.compile(r"answer\D*?(\d+(?:\.\d+)?)", re.IGNORECASE)


class CalculatorTask(BaseModel):
    """Task fields of a calculator row."""

    model_config = ConfigDict(extra="ignore")

    question: str
    expected_answer: str = Field(pattern=r"^\d+$", description="A non-negative integer.")


@dataclass
class CalculatorState:
    expected_answer: int


class CalculatorArguments(BaseModel):
    model_config = ConfigDict(extra="forbid")

    expression: str = Field(
        description="Arithmetic expression with numbers, + - * / // % ** and parentheses, "
        "e.g. (12 + 7) * 3"
    )


def _calculate(state: CalculatorState, arguments: CalculatorArguments) -> ToolReply:
    try:
        return ToolReply(format_number(evaluate_expression(arguments.expression)))
    except ExpressionError as error:
        return ToolReply(f"Error: {error}")


def _reply_to_text(state: CalculatorState, text: str) -> UserReply:
    """An answer without a tool call is the final answer."""
    return UserReply(content=None, done=True)


def final_answer(text: str) -> float | None:
    """The number after the last "answer" in `text`, else its last number, else None."""
    announced = _AFTER_ANSWER.findall(text)
    numbers = announced or _NUMBER.findall(text)
    return float(numbers[-1]) if numbers else None


def _verify(state: CalculatorState, output: list[dict]) -> VerifierFields:
    answer = final_answer(final_assistant_text(output))
    return {
        "reward": 1.0 if answer == state.expected_answer else 0.0,
        "answered": answer is not None,
    }


def _sample_task(rng: random.Random) -> SampledTask:
    name = rng.choice(_NAMES)
    a, b, c = rng.randint(2, 30), rng.randint(2, 30), rng.randint(2, 9)
    small_a, small_b = rng.randint(2, 12), rng.randint(2, 12)
    high, low = max(a, b), min(a, b)
    lost = min(c, small_a * small_b - 1)
    problems = [
        (f"What is {a} + {b}?", a + b),
        (f"What is {high} - {low}?", high - low),
        (f"What is {small_a} * {small_b}?", small_a * small_b),
        (f"{name} has {a} apples and buys {b} more. How many apples does {name} have now?", a + b),
        (f"{name} has {high} marbles and gives away {low}. How many marbles are left?", high - low),
        (f"What is ({a} + {b}) * {c}?", (a + b) * c),
        (
            f"{name} buys {small_a} boxes with {small_b} pencils in each box, then loses {lost} "
            "pencils. How many pencils are left?",
            small_a * small_b - lost,
        ),
        (
            f"{name} has {a} coins, finds {b} more, then spends {low}. How many coins are left?",
            a + b - low,
        ),
    ]
    question, answer = rng.choice(problems)
    fields = {"question": question, "expected_answer": str(answer)}
    return SampledTask(prompt=question, fields=fields)


def _example_solution(question: str, expression: str) -> tuple[dict, ...]:
    """A problem solved with one calculator call and an announced answer, as input items."""
    result = format_number(evaluate_expression(expression))
    arguments = json.dumps({"expression": expression})
    return (
        {"role": "user", "content": question},
        {
            "type": "function_call",
            "call_id": "example_0",
            "name": "calculator",
            "arguments": arguments,
        },
        {"type": "function_call_output", "call_id": "example_0", "output": result},
        {"role": "assistant", "content": f"Answer: {result}"},
    )


CALCULATOR = EnvironmentSpec[CalculatorState](
    name="calculator",
    system_prompt=SYSTEM_PROMPT,
    task=CalculatorTask,
    start=lambda task: CalculatorState(expected_answer=int(task.expected_answer)),
    tools=(
        Tool(
            name="calculator",
            description="Evaluate an arithmetic expression and return its value.",
            arguments=CalculatorArguments,
            call=_calculate,
        ),
    ),
    reply_to_text=_reply_to_text,
    verify=_verify,
    sample_task=_sample_task,
    # Its numbers are beyond every sampled problem's (answers of at most 540), so copying the
    # example's answer earns nothing.
    example=_example_solution("What is 347 + 258?", "347 + 258"),
)

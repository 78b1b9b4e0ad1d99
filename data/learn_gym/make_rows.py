"""Train and held-out rows for `+experiment=learn_gym`: NeMo-Gym's `math_advanced_calculations`.

The environment (shipped in the nemo-gym wheel) gives the model eleven calculator tools from an
"alternate universe" (`add` returns a + b + 1.2, `sin` returns the cosine, ...) and rewards an
episode 1.0 when every expected value appears among the tool outputs, so only calling the right
tool with the right arguments earns it: the value cannot be guessed. Its full data set lives on
Hugging Face, its generator needs Hugging Face too; the wheel ships five example rows. This script
writes rows of the same shape offline, from what the wheel ships: the tools' schemas of its
`data/example.jsonl`, its prompt wording ("Get me the value for ... using only the given tools."),
and the ground truth computed by its own tool functions (`math_advanced_calculations_tools.py`,
loaded from Gym's venv), so a row's expected value is what the server's tool will answer.

Tasks are one operation on two whole numbers 1-9 (`(3.0 + 4.0)`, `log(2.0, 5.0)`) or one number
(`sin(7.0)`): 513 distinct tasks, shuffled by seed and cut into held-out and train rows, so the
two files share no task (tests/data/test_learn_gym_rows.py checks the committed files).

Each row offers three of the eleven tools, the task's own and two others drawn by seed, so the
model must still pick the tool and name its arguments, and its input shows one solved task first
(a user question, the tool call, the tool's answer, a short reply) with another of the three
tools, on numbers 10-19 so it never equals a task. The example's tool answer is the bare number
(the server answers `{"solution": ...}`): SmolLM2-135M-Instruct shown that JSON after the call
wrote it after its own `<tool_call>` instead of a call. Measured at temperature 0.7 on 12 rows x 4
samples (benchmarks/README.md, "Learning on a real Gym environment"): the environment's own
rows (eleven tools, the question alone) 0 rewarded, one solved example with the JSON answer 1
of 63, with the bare answer 0.21 (eleven tools) and 0.27 (three), greedy 0.47 on 32 rows: GRPO
groups with mixed rewards.

    python data/learn_gym/make_rows.py                       # Gym's venv at .venv-gym
    python data/learn_gym/make_rows.py --gym-venv /path/to/.venv-gym --out-dir data/learn_gym
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

ENVIRONMENT = "math_advanced_calculations"
AGENT = f"{ENVIRONMENT}_simple_agent"
OUT_DIR = Path(__file__).resolve().parent

# How the environment's prompts write each operation (its example rows), by tool name.
BINARY = {
    "add": "({a} + {b})",
    "subtract": "({a} - {b})",
    "multiply": "({a} * {b})",
    "divide": "({a} / {b})",
    "power": "{a} ** {b}",
    "log": "log({a}, {b})",
}
UNARY = {"sin": "sin({a})", "cos": "cos({a})", "negate": "-({a})"}
# Argument names of each tool's schema (the server ignores others and fails the call).
BINARY_ARGS = {"log": ("a", "base")}
UNARY_ARG = {"sin": "radians", "cos": "radians", "negate": "a"}
TASK_NUMBERS = range(1, 10)
EXAMPLE_NUMBERS = range(10, 20)
TOOLS_PER_ROW = 3

SYSTEM_PROMPT = (
    "You are a calculator assistant in an alternate universe where the tools do not compute "
    "what their names say. Never compute a value yourself: call the tool for the operation "
    "with the numbers of the question, then reply with the tool's result."
)


def environment_dir(gym_venv: Path) -> Path:
    """The environment's folder inside Gym's venv (site-packages/resources_servers/...)."""
    found = sorted(gym_venv.glob(f"lib/python3*/site-packages/resources_servers/{ENVIRONMENT}"))
    if not found:
        raise SystemExit(
            f"{gym_venv}: no resources_servers/{ENVIRONMENT} in its site-packages; make Gym's "
            "venv with `make gym-venv` or pass --gym-venv"
        )
    return found[-1]


def load_tools_module(env_dir: Path) -> ModuleType:
    """The environment's own tool functions (math only; nothing of nemo_gym is imported)."""
    path = env_dir / f"{ENVIRONMENT}_tools.py"
    spec = importlib.util.spec_from_file_location(f"{ENVIRONMENT}_tools", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tool_schemas(env_dir: Path) -> list[dict[str, Any]]:
    """The tools exactly as the environment's example rows offer them."""
    with (env_dir / "data" / "example.jsonl").open() as lines:
        first = json.loads(next(lines))
    return first["responses_create_params"]["tools"]


def all_tasks(tools: ModuleType, numbers: range) -> list[tuple[str, str, dict[str, float], float]]:
    """(expression, tool, arguments, expected value) of every one-operation task on `numbers`."""
    tasks = []
    for name, shape in BINARY.items():
        first, second = BINARY_ARGS.get(name, ("a", "b"))
        function: Callable[..., float] = getattr(tools, name)
        for a in numbers:
            for b in numbers:
                value = function(float(a), float(b))
                arguments = {first: float(a), second: float(b)}
                tasks.append((shape.format(a=float(a), b=float(b)), name, arguments, value))
    for name, shape in UNARY.items():
        function = getattr(tools, name)
        for a in numbers:
            arguments = {UNARY_ARG[name]: float(a)}
            tasks.append((shape.format(a=float(a)), name, arguments, function(float(a))))
    return tasks


def question(expression: str) -> str:
    return f"Get me the value for {expression} using only the given tools."


def solved_example(task: tuple[str, str, dict[str, float], float]) -> list[dict[str, Any]]:
    """A solved task as Responses input items: question, tool call, tool output, reply."""
    expression, name, arguments, value = task
    return [
        {"role": "user", "content": question(expression)},
        {
            "type": "function_call",
            "call_id": "call_example",
            "name": name,
            "arguments": json.dumps(arguments),
        },
        {
            "type": "function_call_output",
            "call_id": "call_example",
            "output": str(value),
        },
        {"role": "assistant", "content": f"The value is {value}."},
    ]


def make_row(
    row_id: int,
    task: tuple[str, str, dict[str, float], float],
    example: tuple[str, str, dict[str, float], float],
    tools: list[dict[str, Any]],
) -> dict[str, Any]:
    expression, _, _, value = task
    return {
        "id": row_id,
        "responses_create_params": {
            "input": [
                {"role": "system", "content": SYSTEM_PROMPT},
                *solved_example(example),
                {"role": "user", "content": question(expression)},
            ],
            "tools": tools,
            "parallel_tool_calls": False,
        },
        "ground_truth": json.dumps([value]),
        "depth": 1,
        "breadth": 1,
        "agent_ref": {"type": "responses_api_agents", "name": AGENT},
    }


def split_rows(
    tools: ModuleType, schemas: list[dict[str, Any]], *, num_val: int, seed: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, held-out): every task once, shuffled by `seed`; the first `num_val` are held out.

    Each row offers its task's tool, the tool of its solved example (another operation, drawn on
    10-19) and TOOLS_PER_ROW - 2 more of the environment's tools, in an order drawn by `seed`.
    """
    rng = random.Random(seed)
    tasks = all_tasks(tools, TASK_NUMBERS)
    examples = all_tasks(tools, EXAMPLE_NUMBERS)
    by_name = {schema["name"]: schema for schema in schemas}
    rng.shuffle(tasks)
    rows = []
    for row_id, task in enumerate(tasks):
        example = rng.choice([e for e in examples if e[1] != task[1]])
        rest = sorted(set(by_name) - {task[1], example[1]})
        offered = [task[1], example[1], *rng.sample(rest, TOOLS_PER_ROW - 2)]
        rng.shuffle(offered)
        rows.append(make_row(row_id, task, example, [by_name[name] for name in offered]))
    return rows[num_val:], rows[:num_val]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {len(rows)} rows to {path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Write data/learn_gym/train.jsonl and val.jsonl from Gym's venv."
    )
    parser.add_argument("--gym-venv", type=Path, default=Path(".venv-gym"))
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    parser.add_argument("--num-val", type=int, default=128)
    parser.add_argument("--seed", type=int, default=35)
    args = parser.parse_args(argv)
    env_dir = environment_dir(args.gym_venv)
    train, val = split_rows(
        load_tools_module(env_dir), tool_schemas(env_dir), num_val=args.num_val, seed=args.seed
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out_dir / "train.jsonl", train)
    write_jsonl(args.out_dir / "val.jsonl", val)


if __name__ == "__main__":
    main(sys.argv[1:])

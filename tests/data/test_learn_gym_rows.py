"""The rows of `+experiment=learn_gym` (data/learn_gym/): train and held-out share no task, and
the committed files are what `data/learn_gym/make_rows.py` writes from Gym's venv."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data" / "learn_gym"
GYM_VENV = ROOT / ".venv-gym"


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines()]


def _task(row: dict) -> str:
    """What the model is asked: the last user message (the solved example comes before it)."""
    inputs = row["responses_create_params"]["input"]
    return [item["content"] for item in inputs if item.get("role") == "user"][-1]


def test_train_and_held_out_rows_share_no_task():
    train, val = _rows("train.jsonl"), _rows("val.jsonl")
    assert len(val) >= 128
    train_tasks, val_tasks = {_task(r) for r in train}, {_task(r) for r in val}
    assert len(train_tasks) == len(train) and len(val_tasks) == len(val), "a task repeats"
    assert train_tasks.isdisjoint(val_tasks)
    assert all(len(json.loads(r["ground_truth"])) == 1 for r in train + val)


def test_no_row_shows_its_own_task_as_the_solved_example():
    for row in _rows("train.jsonl") + _rows("val.jsonl"):
        inputs = row["responses_create_params"]["input"]
        users = [item["content"] for item in inputs if item.get("role") == "user"]
        assert len(users) == 2 and users[0] != users[1]


def _called_tool(row: dict) -> str:
    """The tool of the row's solved example (its one function_call item)."""
    inputs = row["responses_create_params"]["input"]
    return next(item["name"] for item in inputs if item.get("type") == "function_call")


def test_every_row_names_the_environment_s_agent_and_offers_three_of_its_tools():
    environment_tools = {"add", "subtract", "multiply", "divide", "power", "log", "sin", "cos"}
    environment_tools |= {"negate", "pi", "return_constant"}
    for row in _rows("train.jsonl") + _rows("val.jsonl"):
        assert row["agent_ref"] == {
            "type": "responses_api_agents",
            "name": "math_advanced_calculations_simple_agent",
        }
        names = [tool["name"] for tool in row["responses_create_params"]["tools"]]
        assert len(set(names)) == len(names) == 3 and set(names) <= environment_tools
        assert _called_tool(row) in names


def test_the_solved_example_answers_with_the_bare_number_not_the_server_s_json():
    """The model copied `{"solution": ...}` after its own `<tool_call>` when shown the JSON."""
    for row in _rows("train.jsonl") + _rows("val.jsonl"):
        inputs = row["responses_create_params"]["input"]
        output = next(i["output"] for i in inputs if i.get("type") == "function_call_output")
        float(output)


def _make_rows_module():
    spec = importlib.util.spec_from_file_location("make_rows", DATA / "make_rows.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # the slow suite runs after `make gym-venv` (`make test-slow`, .ci/run)
def test_the_script_writes_the_committed_files_again(tmp_path):
    """Reproducible: the same seed and Gym's shipped environment give the same bytes."""
    assert (GYM_VENV / "bin" / "ng_run").is_file(), "NeMo-Gym's venv is missing: make gym-venv"
    _make_rows_module().main(["--gym-venv", str(GYM_VENV), "--out-dir", str(tmp_path)])
    for name in ("train.jsonl", "val.jsonl"):
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), name

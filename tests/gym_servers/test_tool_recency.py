"""The tool-output recency policy of `gym_servers/.../simple_agent_with_tool_recency`, run by
NeMo-Gym's own compaction session (`ContextCompactionSession`) in Gym's venv, as the agent runs
it: which outputs a call sees, where the agent declares segments, and what prefix each call
requires. Needs `.venv-gym` (`make gym-venv`), so `slow` with the other tests that need it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
GYM_PYTHON = ROOT / ".venv-gym" / "bin" / "python"

# Five model calls, each calling a tool whose output the next call sees, through Gym's session
# with the policy; prints, per call, its segment, its required prefix's length (None: a segment's
# first call) and the request's items, then the boundaries. A call's prompt is its prefix (or a
# fresh 3-token render) plus one token; it samples two.
SESSION = """
import asyncio, json, sys
from responses_api_agents.simple_agent_with_tool_recency.tool_recency import register
from responses_api_agents.simple_agent_with_compaction.compaction import (
    ContextCompactionSession, ContextHistoryConfig, build_generation_contract)
from nemo_gym.openai_utils import NeMoGymResponseCreateParamsNonStreaming

register()
history = ContextHistoryConfig.model_validate(json.loads(sys.argv[1]))
body = NeMoGymResponseCreateParamsNonStreaming(input=[
    {"role": "user", "content": "example"},
    {"type": "function_call", "call_id": "ex", "name": "add", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "ex", "output": "example output"},
    {"role": "user", "content": "task"},
])
session = ContextCompactionSession(
    config=history, rollout_id="r", initial_context=body.input,
    generation_contract=build_generation_contract(
        body=body, model_server={"name": "policy_model"}, context_history=history))

def item(i):
    return i.get("output") or i.get("content") or i["type"]

async def main():
    calls = []
    for step in range(1, 6):
        call = await session.prepare_model_call(turn_id=step)
        prefix = call.required_prefix_token_ids
        calls.append([call.prepared_history.segment_index, None if prefix is None else len(prefix),
                      [item(i) for i in call.request_input]])
        ids = {"prompt_token_ids": [*(prefix or (1, 2, 3)), 4],
               "generation_token_ids": [5, 6], "generation_log_probs": [-1.0, -1.0]}
        session.record_model_response(call=call, finish_reason=None, output_items=[
            {"type": "function_call", "call_id": f"c{step}", "name": "add", "arguments": "{}",
             "id": f"fc{step}", "status": "completed", **ids}])
        session.append_observation(
            [{"type": "function_call_output", "call_id": f"c{step}", "output": f"out{step}"}],
            turn_id=step, conditions_action_turn=step + 1)
    print(json.dumps({"calls": calls, "boundaries": [
        b.applies_to_step for b in session.history_controller.boundary_events]}))

asyncio.run(main())
"""


def run_session(history: dict) -> dict:
    if not GYM_PYTHON.is_file():
        pytest.fail("NeMo-Gym's venv is missing: run `make gym-venv` first")
    done = subprocess.run(
        [str(GYM_PYTHON), "-c", SESSION, json.dumps(history)],
        env=os.environ | {"PYTHONPATH": str(ROOT / "gym_servers")},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def policy(**config) -> dict:
    return {"enabled": True, "policy": {"type": "tool_output_recency", "config": config}}


MARK = "[earlier tool output omitted]"


def test_the_latest_output_is_kept_and_each_older_one_becomes_a_marker_in_its_place():
    """Rolling schedule: call 2 extends call 1 (prefix = its prompt and sampled ids); from call 3
    on each call replaces one more output by the marker, so each starts a segment (no prefix)."""
    done = run_session(policy(keep_last_outputs=1))
    calls = done["calls"]
    assert [(segment, prefix) for segment, prefix, _ in calls] == [
        (0, None),
        (0, 6),  # call 1's prompt (3 + 1 tokens) and its 2 sampled tokens
        (1, None),
        (2, None),
        (3, None),
    ]
    assert done["boundaries"] == [3, 4, 5]
    example = ["example", "function_call", "example output", "task"]
    assert calls[2][2] == [*example, "function_call", MARK, "function_call", "out2"]
    call = "function_call"
    assert calls[4][2] == [*example, call, MARK, call, MARK, call, MARK, call, "out4"]


def test_the_rows_own_outputs_count_when_not_protected_so_the_second_call_compacts():
    done = run_session(policy(keep_last_outputs=1, protect_initial_context=False))
    calls = done["calls"]
    assert calls[0][2][2] == "example output"  # the window holds it while no tool answered
    assert (calls[1][0], calls[1][1]) == (1, None)
    assert calls[1][2][:4] == ["example", "function_call", MARK, "task"]
    assert done["boundaries"] == [2, 3, 4, 5]


def test_chunks_of_two_actions_keep_a_prefix_inside_each_segment():
    """Gym's turn_chunked_recency schedule rewrites the history once per chunk of two calls: a
    segment's second call extends its first."""
    history = policy(keep_last_outputs=1) | {
        "schedule": {"type": "turn_chunked_recency", "actions_per_chunk": 2}
    }
    done = run_session(history)
    assert [(segment, prefix) for segment, prefix, _ in done["calls"]] == [
        (0, None),
        (0, 6),
        (1, None),
        (1, 6),
        (2, None),
    ]
    assert done["boundaries"] == [3, 5]


def test_an_unknown_policy_key_is_refused_by_name():
    if not GYM_PYTHON.is_file():
        pytest.fail("NeMo-Gym's venv is missing: run `make gym-venv` first")
    done = subprocess.run(
        [str(GYM_PYTHON), "-c", SESSION, json.dumps(policy(keep_last=1))],
        env=os.environ | {"PYTHONPATH": str(ROOT / "gym_servers")},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0 and "keep_last" in done.stderr
    assert "Extra inputs are not permitted" in done.stderr

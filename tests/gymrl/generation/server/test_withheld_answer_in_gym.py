"""The policy server's withheld answer (`generation.server.stop_on_divergence`) read by NeMo-Gym's
own `vllm_model` adapter code, as a Gym deployment reads it.

The server answers a diverged request with no text, no tool calls and an empty generation. That
only stops the tail if Gym's converter keeps the answer's token bundle on an output item (else the
episode looks contiguous and nothing is counted) and ends the episode (no tool call). Gym's own
classes run in its venv (`.venv-gym`, `make gym-venv`; .ci/run makes it before the slow suite), so
this test is `slow` with the other tests that need that venv.
"""

from __future__ import annotations

import json
import subprocess
from functools import partial
from pathlib import Path

import pytest

from gymrl.generation.server.divergence_watch import DivergenceWatch
from gymrl.model.tokens import decode_text
from nemo_gym_ext.config import NemoGymPostprocessConfig
from nemo_gym_ext.postprocess import postprocess_gym_result
from tests.gymrl.generation.server.scripted_server import (
    USER_ONLY,
    ScriptedEngine,
    char_level_reply,
    completion,
    served,
)

pytestmark = pytest.mark.slow

GYM_PYTHON = Path(__file__).resolve().parents[4] / ".venv-gym" / "bin" / "python"

# What Gym's vllm_model adapter does with a chat completion when it returns token information
# (responses_api_models/vllm_model/app.py: the message validated as the training variant, the
# completion validated, then VLLMConverter.postprocess_chat_response per choice).
GYM_CONVERSION = """
import json, sys
from nemo_gym.openai_utils import NeMoGymChatCompletion, NeMoGymChatCompletionMessageForTraining
from nemo_gym.responses_converter import VLLMConverter

converter = VLLMConverter(return_token_id_information=True, uses_reasoning_parser=False)
items = []
for completion in json.load(sys.stdin):
    choice = completion["choices"][0]
    choice["message"] = NeMoGymChatCompletionMessageForTraining.model_validate(choice["message"])
    parsed = NeMoGymChatCompletion.model_validate(completion)
    output = converter.postprocess_chat_response(parsed.choices[0])
    items.append([item.model_dump(mode="json", exclude_none=True) for item in output])
json.dump(items, sys.stdout)
"""


def gym_output_items(completions: list[dict]) -> list[list[dict]]:
    """Each completion's Responses output items, as Gym's adapter makes them."""
    if not GYM_PYTHON.is_file():
        pytest.fail("NeMo-Gym's venv is missing: run `make gym-venv` first")
    done = subprocess.run(
        [str(GYM_PYTHON), "-c", GYM_CONVERSION],
        input=json.dumps(completions),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_gym_keeps_the_withheld_answers_bundle_and_truncation_sees_it_stopped(
    tokenizer, chat_format
):
    engine_reply = char_level_reply(tokenizer, chat_format, "five is the sum")
    engine = ScriptedEngine(engine_reply)
    watch = DivergenceWatch(capacity=64, stop=True, marks_last_s=None)
    with served(engine, chat_format, divergence_watch=watch) as client:
        first = completion(client, USER_ONLY).json()
        text_only = [
            *USER_ONLY,
            {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And 3 + 4?"},
        ]
        withheld = completion(client, text_only).json()
    assert withheld["choices"][0]["finish_reason"] == "content_filter"

    first_items, withheld_items = gym_output_items([first, withheld])
    (last,) = withheld_items
    assert last["type"] == "message"
    assert not any(item["type"] == "function_call" for item in withheld_items)
    assert last["prompt_token_ids"] == withheld["choices"][0]["message"]["prompt_token_ids"]
    assert last["generation_token_ids"] == last["generation_log_probs"] == []

    row = {
        "id": "row-0",
        "responses_create_params": {"input": USER_ONLY},
        "agent_ref": {"type": "responses_api_agents", "name": "calculator_agent"},
    }
    result = {
        **row,
        "response": {"output": [*first_items, {"role": "user", "content": "And 3 + 4?"}, last]},
        "reward": 0.0,
    }
    done = postprocess_gym_result(
        row,
        result,
        NemoGymPostprocessConfig(truncate_noncontiguous_episodes=True),
        decode=partial(decode_text, tokenizer, skip_special_tokens=False),
        server_stops_divergences=True,
    )
    full = done.full_result
    assert full["noncontiguous_truncated"] is True
    assert full["noncontiguous_stopped"] is True
    causes = [k for k, v in full.items() if k.startswith("noncontiguous_cause/") and v]
    assert causes == ["noncontiguous_cause/no_token_ids"], full
    generated = [entry["token_ids"] for entry in done.message_log if entry["role"] == "assistant"]
    assert generated == [engine_reply]

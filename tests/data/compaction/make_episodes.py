"""Write compacted episodes the way NeMo-Gym's `simple_agent_with_compaction` reports them.

Runs in NeMo-Gym's venv (`make gym-venv`): `.venv-gym/bin/python
tests/data/compaction/make_episodes.py --out tests/data/compaction/episodes.json`. Each episode
is driven through Gym's own `ContextCompactionSession` (reasoning recency keeping the latest
block, so every call after the second drops an older reasoning block and opens a new segment
every `actions_per_chunk` calls), answered by a stand-in model server that honours
`required_prefix_token_ids` exactly as the contract asks: the prompt is the prefix followed by
the ids of what follows the last assistant turn, or, at a segment's first call, the ids of the
whole view. Ids are the characters of a JSON rendering of the items (modulo SmolLM2's
vocabulary), so a compacted view re-renders into other ids where it changed. The result is
what the agent's `/run` returns after Gym's `/verify` (`build_transport_response`, schema 3),
inside a Gym result (`reward`, `agent_ref`). The committed file is this script's output; a slow
test checks that it still is (tests/nemo_gym_ext/test_compaction_contract_gym.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from nemo_gym.openai_utils import NeMoGymResponse, NeMoGymResponseCreateParamsNonStreaming
from responses_api_agents.simple_agent_with_compaction.compaction import (
    CompactionScheduleConfig,
    ContextCompactionSession,
    ContextHistoryConfig,
    HistoryPolicyConfig,
    build_generation_contract,
    build_transport_response,
)
from responses_api_agents.simple_agent_with_compaction.compaction.config import (
    ReasoningRecencyConfig,
    RecencyHistoryPolicyConfig,
)

VOCAB_SIZE = 49152
AGENT = "compacting_agent"


def encode(items) -> list[int]:
    """The stand-in tokenizer: one id per character of the items' JSON."""
    text = "".join(json.dumps(item, sort_keys=True) for item in items)
    return [ord(character) % VOCAB_SIZE for character in text]


def after_last_assistant(items) -> list:
    """What follows the last item the model wrote (its reasoning or tool call)."""
    written = [
        i for i, item in enumerate(items) if item.get("type") in ("reasoning", "function_call")
    ]
    return list(items[written[-1] + 1 :]) if written else list(items)


def serve(request_input, required_prefix, turn: int) -> list[dict]:
    """One model call's output items: a reasoning block and a tool call carrying the ids."""
    items = [dict(item) for item in request_input]
    if required_prefix is None:
        prompt = encode(items)
    else:
        prompt = [*required_prefix, *encode(after_last_assistant(items))]
    call = {"name": "add", "arguments": json.dumps({"a": turn, "b": 2 * turn})}
    generation = [*encode([call])[:24], 2]
    return [
        {
            "type": "reasoning",
            "id": f"rs_{turn}",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": f"step {turn}: add"}],
        },
        {
            "type": "function_call",
            "id": f"fc_{turn}",
            "call_id": f"call_{turn}",
            "status": "completed",
            **call,
            "prompt_token_ids": prompt,
            "generation_token_ids": generation,
            "generation_log_probs": [-((token % 13) + 1) / 16 for token in generation],
        },
    ]


async def episode(rollout_id: str, turns: int, actions_per_chunk: int) -> dict:
    config = ContextHistoryConfig(
        enabled=True,
        policy=HistoryPolicyConfig(
            type="recency",
            config=RecencyHistoryPolicyConfig(
                reasoning=ReasoningRecencyConfig(enabled=True, keep_last_blocks=1)
            ),
        ),
        schedule=CompactionScheduleConfig(
            type="turn_chunked_recency", actions_per_chunk=actions_per_chunk
        ),
    )
    prompt_items = [
        {"role": "user", "type": "message", "content": "Add the numbers with the tool."}
    ]
    body = {"input": prompt_items, "model": "policy", "tools": []}
    params = NeMoGymResponseCreateParamsNonStreaming.model_validate(body)
    session = ContextCompactionSession(
        config=config,
        rollout_id=rollout_id,
        generation_contract=build_generation_contract(
            body=params, model_server={"name": "policy_model"}, context_history=config
        ),
        initial_context=prompt_items,
    )
    for turn in range(1, turns + 1):
        call = await session.prepare_model_call(turn_id=turn)
        output = serve(call.request_input, call.required_prefix_token_ids, turn)
        session.record_model_response(call=call, output_items=output, finish_reason=None)
        tool_output = {
            "type": "function_call_output",
            "call_id": f"call_{turn}",
            "output": str(3 * turn),
        }
        session.append_observation([tool_output], turn_id=turn, conditions_action_turn=turn + 1)
    session.finalize()
    response = NeMoGymResponse.model_validate(
        {
            "id": f"resp_{rollout_id}",
            "created_at": 0.0,
            "model": "policy",
            "object": "response",
            "output": [],
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
        }
    )
    compacted = session.build_response(response, agent_input=prompt_items)
    transport = build_transport_response(compacted)
    return {
        "id": rollout_id,
        "reward": 1.0,
        "agent_ref": {"type": "responses_api_agents", "name": AGENT},
        "response": transport.model_dump(mode="json"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    episodes = {
        "two_per_chunk": asyncio.run(
            episode("rollout-two-per-chunk", turns=6, actions_per_chunk=2)
        ),
        "three_per_chunk": asyncio.run(
            episode("rollout-three-per-chunk", turns=7, actions_per_chunk=3)
        ),
    }
    args.out.write_text(json.dumps(episodes, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()

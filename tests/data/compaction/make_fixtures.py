"""Write the compacted Gym results of tests/data/compaction/: what Gym's compaction agent's `/run`
returns (`response.context_compaction_contract` schema 3, `response.model_call_metadata`), each
with the row it ran, from the very servers `+experiment=compaction_gym` runs: this checkout's
policy server in front of an engine, and a Gym deployment launched from Gym's venv with the
experiment's environment, its agent (`gym_servers/.../simple_agent_with_tool_recency`) and
Gym's vllm_model_with_compaction adapter.

* `smollm2_one_compaction.json`: SmolLM2 sampling at the run's temperature on the experiment's
  own agent config, the first episode of the first rows that was compacted (a tool call, then
  the reply as the first call of segment 1).
* `scripted_two_compactions.json`: an engine scripted to call a tool four times and then answer,
  the agent's policy on Gym's `turn_chunked_recency` schedule of two actions and its row's own
  example protected: three segments of calls 1-2, 3-4 and 5 (the answer), the second call of
  each of the first two sent with `required_prefix_token_ids` (the first call's prompt and
  sampled ids).

Token ids are SmolLM2's (its tokenizer decodes them). Needs `.venv-gym` (`make gym-venv`):

    python tests/data/compaction/make_fixtures.py
"""

from __future__ import annotations

import asyncio
import copy
import json
import sys
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import httpx
from pydantic import SecretStr

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from gymrl.config.compose import compose_raw  # noqa: E402
from gymrl.generation.server.app import create_policy_server_app  # noqa: E402
from gymrl.generation.server.chat_template import ChatFormat  # noqa: E402
from gymrl.generation.torch.engine import TorchGenerationEngine  # noqa: E402
from gymrl.model.policy import build_policy, model_folder  # noqa: E402
from gymrl.model.tokens import eos_token_id, model_end_token_ids  # noqa: E402
from gymrl.preflight.validate import validate_config  # noqa: E402
from nemo_gym_ext.gym_launch import PolicyEndpoint, agent_urls, start_deployment  # noqa: E402
from nemo_gym_ext.http_server import serve_in_thread  # noqa: E402
from tests.gymrl.generation.server.scripted_server import ScriptedEngine  # noqa: E402

OUT = Path(__file__).resolve().parent
AGENT = "math_advanced_calculations_simple_agent"
KEY = "fixture-key"
TOOL_CALLS = 4


class ToolCallingEngine(ScriptedEngine):
    """Calls `add` while the prompt holds fewer than TOOL_CALLS of its own calls, then answers."""

    ARGUMENTS = '{"a": 1.0, "b": 2.0}'

    def __init__(self, chat_format: ChatFormat):
        end = [chat_format.end_of_turn_id]
        text = f'<tool_call>\n{{"name": "add", "arguments": {self.ARGUMENTS}}}\n</tool_call>'
        self.call = chat_format.encode(text) + end
        self.answer = chat_format.encode("The value is 4.2.") + end
        self.chat_format = chat_format
        super().__init__(self.call)

    def _answer(self, request):
        calls = self.chat_format.decode(request.prompt_token_ids).count(self.ARGUMENTS)
        self.reply = self.call if calls < TOOL_CALLS else self.answer
        return super()._answer(request)


def run_episodes(config, engine, chat_format, gym_config, rows, work_dir) -> list[dict[str, Any]]:
    """Each row's /run answer from a deployment of `gym_config` against `engine`."""
    server = config.generation.server
    app = create_policy_server_app(
        engine,
        chat_format,
        model_name=config.policy.name,
        api_key=SecretStr(KEY),
        honor_prompt_token_ids=server.honor_prompt_token_ids,
        default_max_tokens=server.max_tokens_per_turn,
        max_context_tokens=config.policy.max_total_sequence_length,
        request_timeout_s=server.request_timeout_s,
        request_bytes_per_context_token=server.request_bytes_per_context_token,
        render_timeout_s=server.render_timeout_s,
    )
    with serve_in_thread(app, max_body_bytes=None) as policy_server:
        deployment = start_deployment(
            gym_config,
            policy=PolicyEndpoint(f"{policy_server.url}/v1", KEY, config.policy.name),
            venv=(ROOT / config.env.gym.venv).resolve(),
            work_dir=work_dir,
            host="127.0.0.1",
            port_range=config.env.gym.port_range,
            timeout_s=config.env.gym.start_timeout_s,
            policy_adapter=config.env.gym.policy_adapter,
            server_roots=[Path(root) for root in config.env.gym.server_roots],
        )
        try:
            url = agent_urls(deployment.head_url, timeout_s=30)[AGENT] + "/run"

            async def run_all():
                async with httpx.AsyncClient(timeout=config.env.rollout.run_timeout_s) as client:
                    answers = await asyncio.gather(*(client.post(url, json=row) for row in rows))
                for answer in answers:
                    answer.raise_for_status()
                return [answer.json() for answer in answers]

            return asyncio.run(run_all())
        finally:
            deployment.stop()


def write(name: str, row: dict[str, Any], result: dict[str, Any]) -> None:
    response = result["response"]
    assert response["context_compaction_contract"]["schema_version"] == 3
    segments = [call["segment_index"] for call in response["model_call_metadata"]]
    path = OUT / name
    path.write_text(json.dumps({"row": row, "result": result}) + "\n")
    print(f"wrote {path}: model calls in segments {segments}")


def main() -> None:
    config = validate_config(compose_raw(["+experiment=compaction_gym"]))
    (shard,) = config.gym_shards
    rows = [json.loads(line) for line in (ROOT / config.env.data.train_jsonl).open()][:16]
    for row in rows:  # what the training server enforces: the run's sampling
        row["responses_create_params"]["temperature"] = config.generation.sampling.temperature
    model, tokenizer = build_policy(config.policy, config.run.seed)
    end_ids = model_end_token_ids(model_folder(config.policy))
    chat_format = ChatFormat.from_policy(config.policy, tokenizer, model_end_ids=end_ids)

    with TemporaryDirectory() as scratch:
        engine = ToolCallingEngine(chat_format)
        scripted_config = copy.deepcopy(shard.gym_config)
        agent = scripted_config[AGENT]["responses_api_agents"]["simple_agent_with_tool_recency"]
        agent["max_steps"] = TOOL_CALLS + 2
        agent["context_history"]["policy"]["config"]["protect_initial_context"] = True
        agent["context_history"]["schedule"] = {
            "type": "turn_chunked_recency",
            "actions_per_chunk": 2,
        }
        (result,) = run_episodes(
            config, engine, chat_format, scripted_config, rows[:1], Path(scratch) / "scripted"
        )
        write("scripted_two_compactions.json", rows[0], result)

        engine = TorchGenerationEngine.from_config(
            model,
            config.generation,
            seed=config.run.seed,
            compute_dtype=config.policy.compute_dtype,
            eos_token_ids=[eos_token_id(tokenizer), *end_ids],
        )
        try:
            results = run_episodes(
                config, engine, chat_format, shard.gym_config, rows, Path(scratch) / "smollm2"
            )
        finally:
            engine.close()
    compacted = [
        (row, result)
        for row, result in zip(rows, results, strict=True)
        if result["response"]["boundary_events"]
    ]
    if not compacted:
        raise SystemExit(f"none of {len(rows)} SmolLM2 episodes was compacted; run it again")
    write("smollm2_one_compaction.json", *compacted[0])


if __name__ == "__main__":
    main()

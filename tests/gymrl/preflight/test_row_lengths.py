"""The dry run counts each row's prompt with the real SmolLM2 tokenizer and chat template, and
names the rows that leave less than one turn of the context and those that do not render."""

import json

from gymrl.config.compose import compose_raw
from gymrl.generation.server.chat_template import row_prompt_token_count
from gymrl.preflight.plan import render_plan
from gymrl.preflight.row_lengths import measure_rows
from gymrl.preflight.validate import validate_config

AGENT_REF = {"type": "responses_api_agents", "name": "some_agent"}
TOOL = {
    "type": "function",
    "name": "add",
    "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}}},
}


def _row(text: str, *, tools=(TOOL,), example: bool = False) -> dict:
    solved = [
        {"role": "user", "content": "Get me (1 + 2)."},
        {"type": "function_call", "call_id": "c0", "name": "add", "arguments": '{"a": 1}'},
        {"type": "function_call_output", "call_id": "c0", "output": '{"solution": 4.2}'},
        {"role": "assistant", "content": "The value is 4.2."},
    ]
    items = [*(solved if example else []), {"role": "user", "content": text}]
    return {
        "responses_create_params": {"input": items, "tools": list(tools)},
        "agent_ref": AGENT_REF,
    }


def test_the_count_is_the_rendered_prompt_s_tokens(chat_format):
    row = _row("What is 2 + 3?")
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    tools = [{"type": "function", "function": {k: TOOL[k] for k in TOOL if k != "type"}}]
    text = chat_format.tokenizer.apply_chat_template(
        messages,
        tools=tools,
        chat_template=chat_format.template,
        add_generation_prompt=True,
        tokenize=False,
    )
    assert row_prompt_token_count(row, chat_format) == len(chat_format.encode(text))
    # A solved example (tool call and output) and the tools count too.
    assert row_prompt_token_count(_row("What is 2 + 3?", example=True), chat_format) > len(
        chat_format.encode(text)
    )
    assert row_prompt_token_count(_row("What is 2 + 3?", tools=()), chat_format) < len(
        chat_format.encode(text)
    )


def test_rows_over_the_context_less_one_turn_and_rows_that_do_not_render_are_named(
    tmp_path, chat_format
):
    rows = tmp_path / "rows.jsonl"
    lines = [
        json.dumps(_row("short")),
        json.dumps(_row("word " * 3000)),
        "",
        json.dumps({"responses_create_params": {"input": []}, "agent_ref": AGENT_REF}),
        json.dumps(_row("a bit longer question " * 5, example=True)),
    ]
    rows.write_text("\n".join(lines) + "\n")
    measured = measure_rows(str(rows), chat_format, context=2048, turn_tokens=64)
    assert measured.rows == 4
    assert measured.longest_line == 2 and measured.longest > 3000
    assert [line for line, _ in measured.too_long] == [2]
    assert [line for line, _ in measured.unreadable] == [4]
    text = measured.describe(2048, 64)
    assert f"{rows}: 4 rows, longest prompt {measured.longest} tokens (line 2)" in text
    assert "1 leave less than one turn (64 tokens) of the context: line 2" in text
    assert "1 do not render, first line 4: ValidationError" in text


def test_the_dry_run_plan_counts_the_rows_of_a_gym_experiment():
    config = validate_config(compose_raw(["+experiment=gym_example", "dry_run=true"]))
    plan = render_plan(config, "out")
    (line,) = [line for line in plan.splitlines() if line.strip().startswith("prompts")]
    assert "data/gym_example/train.jsonl: 8 rows, longest prompt" in line
    assert "of context 2048" in line and "less than one turn" not in line
    # A run's own plan leaves them to the run (each row is named as it comes up).
    started = render_plan(validate_config(compose_raw(["+experiment=gym_example"])), "out")
    assert "    prompts   " not in started


def test_a_missing_rows_file_is_named_not_a_crash():
    overrides = ["+experiment=gym_example", "env.data.train_jsonl=no/such.jsonl", "dry_run=true"]
    config = validate_config(compose_raw(overrides))
    plan = render_plan(config, "out")
    assert "prompts   no/such.jsonl: not counted: FileNotFoundError" in plan

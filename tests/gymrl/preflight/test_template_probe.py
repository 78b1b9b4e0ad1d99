"""The template probe on real tokenizers of each shipped family, and what the plan and the
validator make of its verdicts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gymrl.config.compose import compose_raw
from gymrl.generation.server.chat_template import ChatFormat
from gymrl.generation.server.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS, GenerationParser
from gymrl.preflight.plan import render_plan
from gymrl.preflight.template_probe import (
    REASONING_WRITERS,
    TOOL_CALL_WRITERS,
    compare_with_own_template,
    probe_chat_format,
    probe_policy,
)
from gymrl.preflight.validate import validate_config
from nemo_gym_ext.config_errors import ConfigError
from tests.recipes.test_grpo_entry import run_recipe

QWEN = GenerationParser("hermes", "qwen3")


def test_each_parser_has_a_writer_whose_text_it_reads_back():
    assert set(TOOL_CALL_WRITERS) == set(TOOL_CALL_PARSERS)
    assert set(REASONING_WRITERS) == set(REASONING_PARSERS)
    for tool_parser, write_call in TOOL_CALL_WRITERS.items():
        for reasoning_parser, (write_reasoning, _) in REASONING_WRITERS.items():
            text = write_reasoning("Think.") + write_call("add", {"a": 2})
            parsed = GenerationParser(tool_parser, reasoning_parser).parse(text)
            (call,) = parsed.tool_calls
            assert parsed.reasoning_content == "Think."
            assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 2})


def test_smollm2_with_its_tools_template_is_append_only_both_ways(chat_format):
    with_ids, text_only, prefix = probe_chat_format(chat_format, honor_prompt_token_ids=True)
    assert with_ids.append_only and text_only.append_only and prefix.append_only
    assert "append-only (turns 2-3" in text_only.describe()


def test_llama3_is_append_only_both_ways(llama3_tokenizer):
    llama = ChatFormat(llama3_tokenizer, parser=GenerationParser("llama3_json"))
    with_ids, text_only, prefix = probe_chat_format(llama, honor_prompt_token_ids=True)
    assert with_ids.append_only and text_only.append_only and prefix.append_only


def test_qwen3_thinking_drops_earlier_reasoning_at_the_follow_up(qwen3_tokenizer):
    """After the tool output the reasoning is still written back; once the user speaks again,
    Qwen3's template drops the first turn's <think> block from the history."""
    qwen = ChatFormat(qwen3_tokenizer, parser=QWEN)
    with_ids, text_only, _ = probe_chat_format(qwen, honor_prompt_token_ids=True)
    assert with_ids.append_only
    broken = text_only.divergence
    assert broken is not None and broken.turn == 3
    assert (broken.token_expected, broken.token_found) == ("<think>", "<tool_call>")
    assert text_only.describe().startswith(
        "NOT append-only: turn 2's prompt starts with turn 1's prompt + generation; turn 3's "
        "prompt differs at token"
    )


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "non-thinking"])
def test_qwen3_under_the_compaction_agent_keeps_each_segment_append_only(qwen3_tokenizer, thinking):
    """The flagship's family with Gym's compaction agent: it sends text only, as the client
    above whose history breaks, but names each prompt's prefix; the server builds every turn of a
    segment from it, so the episode stays append-only where the text-only one does not. A
    reasoning-recency compaction opens a new segment, which the recipe trains as declared."""
    kwargs = {} if thinking else {"enable_thinking": False}
    qwen = ChatFormat(qwen3_tokenizer, parser=QWEN, template_kwargs=kwargs)
    _, text_only, prefix = probe_chat_format(qwen, honor_prompt_token_ids=True)
    assert not text_only.append_only
    assert prefix.append_only, prefix.describe()


def test_qwen3_without_thinking_breaks_at_the_first_tool_output(qwen3_tokenizer):
    """The generation prompt's empty think block is not written back into the history."""
    qwen = ChatFormat(qwen3_tokenizer, parser=QWEN, template_kwargs={"enable_thinking": False})
    with_ids, text_only, _ = probe_chat_format(qwen, honor_prompt_token_ids=True)
    assert with_ids.append_only
    broken = text_only.divergence
    assert broken is not None and broken.turn == 2
    assert (broken.token_expected, broken.token_found) == ("<think>", "<tool_call>")
    # Each turn is judged against its own predecessor: the final answer's empty block is lost too.
    assert [divergence.turn for divergence in text_only.divergences] == [2, 3]


def test_a_server_that_ignores_ids_gives_the_text_only_verdict_to_both(qwen3_tokenizer):
    qwen = ChatFormat(qwen3_tokenizer, parser=QWEN)
    with_ids, text_only, prefix = probe_chat_format(qwen, honor_prompt_token_ids=False)
    assert with_ids == text_only and not with_ids.append_only
    assert prefix.append_only  # the contract's prefix is not a sent-back id the server ignores


def test_a_template_the_server_refuses_with_ids_is_named_with_the_turn(tokenizer, tmp_path):
    template = Path(tmp_path, "marks_answered_turns.jinja")
    template.write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% if m.role == 'assistant' and not loop.last %} (answered){% endif %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    marked = ChatFormat(tokenizer, parser=GenerationParser("hermes"), chat_template=str(template))
    with_ids, text_only, prefix = probe_chat_format(marked, honor_prompt_token_ids=True)
    assert with_ids.refused is not None and with_ids.refused.startswith("turn 2: ")
    assert prefix.refused is not None and prefix.refused.startswith("turn 2: ")
    assert "the policy server refuses turn 2" in with_ids.describe()
    assert text_only.divergence is not None and text_only.divergence.turn == 2


def test_a_template_made_for_another_model_is_named(tokenizer, qwen3_tokenizer):
    smollm2_tools = ChatFormat(
        tokenizer, parser=GenerationParser("hermes"), chat_template="smollm2_tools"
    ).template
    said, warn = compare_with_own_template(tokenizer, smollm2_tools, Path("smollm2"))
    assert not warn and "as the model folder's own template does" in said
    said, warn = compare_with_own_template(qwen3_tokenizer, smollm2_tools, Path("qwen3"))
    assert warn and "named SmolLM" in said and "policy.chat_template=null" in said


@pytest.fixture(scope="module")
def qwen3_folder(qwen3_tokenizer, tmp_path_factory) -> Path:
    """A local Qwen3 model folder as the validator reads one: tokenizer files and config.json."""
    folder = tmp_path_factory.mktemp("models") / "qwen3"
    shutil.copytree(qwen3_tokenizer.name_or_path, folder)
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 40960}))
    return folder


def _qwen3_overrides(folder: Path, *more: str) -> list[str]:
    return [
        "policy.source=pretrained",
        f"policy.path={folder}",
        "policy.chat_template=null",
        "policy.reasoning_parser=qwen3",
        *more,
    ]


def _plan(*overrides: str) -> str:
    return render_plan(validate_config(compose_raw(list(overrides))), "out")


def _issues(*overrides: str) -> dict[str, str]:
    with pytest.raises(ConfigError) as raised:
        validate_config(compose_raw(list(overrides)))
    return {issue.key: issue.render() for issue in raised.value.issues}


def test_text_only_agents_without_truncation_are_refused_naming_the_fix(qwen3_folder):
    issues = _issues(
        "+experiment=smoke_noncontiguous",
        *_qwen3_overrides(qwen3_folder, "env.nemo_gym.truncate_noncontiguous_episodes=false"),
    )
    key = "env.nemo_gym.agents.calculator_agent.options.send_token_ids"
    assert set(issues) == {key, key.replace("calculator", "guess_number")}
    assert "is not append-only for a client that sends text only" in issues[key]
    assert "turn 3's prompt differs" in issues[key] and "'<think>'" in issues[key]
    assert "env.nemo_gym.truncate_noncontiguous_episodes=false the run stops" in issues[key]
    assert f"fix: set {key}=true" in issues[key]
    assert "env.nemo_gym.truncate_noncontiguous_episodes=true" in issues[key]


def test_a_server_ignoring_ids_without_truncation_is_refused_once(qwen3_folder):
    issues = _issues(
        *_qwen3_overrides(qwen3_folder, "generation.server.honor_prompt_token_ids=false")
    )
    (rendered,) = issues.values()
    assert "generation.server.honor_prompt_token_ids = False" in rendered
    assert "fix: set generation.server.honor_prompt_token_ids=true" in rendered


@pytest.mark.parametrize(
    "overrides",
    [
        ["+experiment=smoke_noncontiguous"],  # truncation keeps the contiguous prefixes
        [  # the agents send their ids back
            "+experiment=smoke_noncontiguous",
            "env.nemo_gym.truncate_noncontiguous_episodes=false",
            "env.nemo_gym.agents.calculator_agent.options.send_token_ids=true",
            "env.nemo_gym.agents.guess_number_agent.options.send_token_ids=true",
        ],
    ],
)
def test_truncation_or_ids_sent_back_pass_with_the_same_template(qwen3_folder, overrides):
    validate_config(compose_raw(_qwen3_overrides(qwen3_folder, *overrides)))


def test_an_append_only_template_is_not_refused_for_text_only_agents():
    """SmolLM2's tools template passes the probe: the smoke run without truncation still stops
    at its first episode that a sampled tokenisation breaks, as it always has."""
    validate_config(
        compose_raw(
            [
                "+experiment=smoke_noncontiguous",
                "env.nemo_gym.truncate_noncontiguous_episodes=false",
            ]
        )
    )


def test_the_plan_gives_both_verdicts_and_the_clients(smollm2_dir):
    plan = _plan("+experiment=smoke_noncontiguous")
    assert "  template    policy.chat_template=smollm2_tools (renders tool-free chats as" in plan
    assert f"prompt builder, tokenizer from {smollm2_dir}:" in plan
    assert "      ids sent back: append-only" in plan and "      text only: append-only" in plan
    assert (
        "      Gym's compaction agent (text + required_prefix_token_ids), inside a segment: "
        "append-only" in plan
    )
    assert "    clients   default: text only: calculator_agent, guess_number_agent" in plan


def test_the_plan_warns_of_a_template_from_another_model(qwen3_folder):
    plan = _plan("policy.source=pretrained", f"policy.path={qwen3_folder}")
    assert "  WARNING     policy.chat_template=smollm2_tools renders this model's chats" in plan
    plan = _plan(*_qwen3_overrides(qwen3_folder))
    assert "WARNING" not in plan and "text only: NOT append-only: turn 2's prompt starts" in plan


def test_a_tokenizer_not_on_this_machine_is_said_not_probed(tmp_path):
    plan = _plan("+experiment=swe_bench_30b")
    assert "probe     not run: policy.path 'Qwen/Qwen3-30B-A3B' is not a folder" in plan
    assert "clients   openhands: unknown to the recipe: the joined Gym deployment" in plan
    policy = validate_config(compose_raw([f"policy.model_cache_dir={tmp_path}"])).policy
    probe = probe_policy(policy, honor_prompt_token_ids=True)
    assert probe.not_run is not None and "not converted yet" in probe.not_run
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    plan = _plan("policy.source=pretrained", f"policy.path={tmp_path}")
    assert f"probe     not run: no tokenizer the probe can read in {tmp_path}" in plan


def test_the_probing_dry_run_imports_no_torch(smollm2_dir, tmp_path):
    done = run_recipe("dry_run=true", tmp_path=tmp_path, check_modules=True)
    assert done.returncode == 0, done.stderr
    assert "text only: append-only" in done.stdout
    assert "HEAVY []" in done.stdout

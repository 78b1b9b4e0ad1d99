"""Rollout collection against real servers: a tiny Llama behind the model server, a built-in
environment's agent, and the postprocessor with the shard's config."""

import asyncio

import pytest
from pydantic import SecretStr

from gymrl.config.schema.generation import TorchGenerationConfig
from gymrl.generation.server.app import create_policy_server_app
from gymrl.generation.server.chat_template import row_prompt_token_count
from gymrl.generation.torch.engine import TorchGenerationEngine
from gymrl.model.loading import build_tiny_llama
from nemo_gym_ext.config import NemoGymPostprocessConfig
from nemo_gym_ext.envs.registry import make_rows, start_builtin_environment
from nemo_gym_ext.http_server import serve_in_thread
from nemo_gym_ext.postprocess import NonContiguousEpisodeError
from nemo_gym_ext.rollout import (
    FailureBudget,
    PromptSize,
    RolloutBudgetExceeded,
    RolloutCollector,
    RolloutSettings,
    UnknownAgentError,
)

SETTINGS = RolloutSettings(
    max_concurrent_rollouts=4,
    run_timeout_s=60,
    max_retries=1,
    max_result_bytes=2**26,
    retry_backoff_s=0.01,
    retry_backoff_max_s=0.1,
    server_stops_divergences=False,
)
AGENT = "guess_number_agent"


@pytest.fixture(scope="module")
def policy_url(tokenizer, chat_format):
    model = build_tiny_llama(
        tokenizer, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=0
    )
    engine = TorchGenerationEngine.from_config(
        model, TorchGenerationConfig(max_batch_size=8), seed=0, compute_dtype="float32"
    )
    app = create_policy_server_app(
        engine,
        chat_format,
        model_name="tiny",
        api_key=SecretStr("key"),
        honor_prompt_token_ids=True,
        default_max_tokens=24,
        max_context_tokens=2048,
        request_timeout_s=60,
        request_bytes_per_context_token=1024,
        render_timeout_s=60,
    )
    with serve_in_thread(app) as server:
        yield f"{server.url}/v1"


def start_agent(policy_url, *, send_token_ids):
    return start_builtin_environment(
        "guess_number",
        agent_name=AGENT,
        policy_base_url=policy_url,
        policy_api_key="key",
        options={
            "policy_model": "tiny",
            "max_turns": 3,
            "continue_after_length": True,
            "send_token_ids": send_token_ids,
        },
    )


def collect(agent_urls, config, row, episodes, tokenizer, prompt_size=None):
    async def go():
        collector = RolloutCollector(
            agent_urls,
            config,
            SETTINGS,
            vocab_size=len(tokenizer),
            decode=tokenizer.decode,
            prompt_size=prompt_size,
        )
        try:
            return await collector.run_group(row, episodes)
        finally:
            await collector.aclose()

    return asyncio.run(go())


ROW = make_rows("guess_number", 1, seed=3, agent_name=AGENT)[0]


def test_a_group_is_postprocessed_training_data(policy_url, tokenizer):
    with start_agent(policy_url, send_token_ids=True) as env:
        outcome = collect({AGENT: env.agent_url}, NemoGymPostprocessConfig(), ROW, 3, tokenizer)
    assert (outcome.agent, outcome.row_id, outcome.failures, outcome.retries) == (
        AGENT,
        ROW["id"],
        [],
        0,
    )
    assert len(outcome.episodes) == 3
    for episode in outcome.episodes:
        roles = [entry["role"] for entry in episode.message_log]
        assert roles == ["user", "assistant"] * 3, "three contiguous turns"
        assert episode.full_result["noncontiguous_truncated"] is False


def test_text_only_agents_break_contiguity_and_truncation_keeps_the_prefix(policy_url, tokenizer):
    with start_agent(policy_url, send_token_ids=False) as env:
        truncating = NemoGymPostprocessConfig(truncate_noncontiguous_episodes=True)
        # Re-tokenising a random model's text breaks contiguity in most episodes (measured: 34
        # of 40 with this setup), so all 8 staying contiguous has odds below 1e-6.
        outcome = collect({AGENT: env.agent_url}, truncating, ROW, 8, tokenizer)
        assert any(e.full_result["noncontiguous_truncated"] for e in outcome.episodes)
        for episode in outcome.episodes:
            assert episode.message_log, "a truncated episode keeps its contiguous prefix"
        with pytest.raises(NonContiguousEpisodeError, match="guess_number_agent"):
            collect({AGENT: env.agent_url}, NemoGymPostprocessConfig(), ROW, 8, tokenizer)


def test_transport_failures_are_retried_then_reported_not_raised(tokenizer):
    unreachable = {AGENT: "http://127.0.0.1:9"}  # discard port: connection refused
    outcome = collect(unreachable, NemoGymPostprocessConfig(), ROW, 2, tokenizer)
    assert outcome.episodes == []
    assert outcome.retries == 2
    assert len(outcome.failures) == 2
    assert "failed after 2 attempts: ConnectError" in outcome.failures[0]


def test_a_row_for_an_agent_the_shard_does_not_serve_is_refused(tokenizer):
    with pytest.raises(UnknownAgentError, match="does not serve"):
        collect(
            {"other_agent": "http://127.0.0.1:9"}, NemoGymPostprocessConfig(), ROW, 1, tokenizer
        )


def test_the_failure_budget_stops_the_run_with_the_last_cause():
    budget = FailureBudget(limit=2)
    budget.record([], episodes=4)
    budget.record(["agent 'a' row '1' failed after 3 attempts: ConnectError"], episodes=4)
    budget.record(["agent 'a' row '2' failed after 3 attempts: ReadTimeout"], episodes=4)
    assert budget.count == 2
    with pytest.raises(RolloutBudgetExceeded) as stopped:
        budget.record(["agent 'a' row '3' failed after 3 attempts: ConnectError"], episodes=4)
    assert str(stopped.value).startswith(
        "3 of 16 episodes failed after retries, more than env.rollout.failure_budget=2 + "
        "env.rollout.failure_rate=0 x 16 episodes = 2; "
        "last cause: agent 'a' row '3' failed after 3 attempts: ConnectError. "
    )
    assert "env.rollout.on_episode_error=reward" in str(stopped.value)


def _long_row():
    params = ROW["responses_create_params"]
    long_system = {"role": "system", "content": "Think step by step. " * 600}
    return {**ROW, "responses_create_params": {**params, "input": [long_system, *params["input"]]}}


def test_a_prompt_the_policy_server_would_refuse_is_named_and_never_sent(tokenizer, chat_format):
    """Measured before sending: a row whose prompt (system prompt, tools, input, as the policy
    server renders them) does not fit the context is refused at once, never posted (the agent
    URL here refuses connections, so a post would show as a failure)."""
    row = _long_row()
    size = PromptSize(lambda row: row_prompt_token_count(row, chat_format), context_tokens=2048)
    unreachable = {AGENT: "http://127.0.0.1:9"}
    outcome = collect(unreachable, NemoGymPostprocessConfig(), row, 2, tokenizer, size)
    tokens = row_prompt_token_count(row, chat_format)
    assert tokens > 2048
    assert (outcome.episodes, outcome.failures, outcome.retries) == ([], [], 0)
    assert outcome.prompt_refused == (
        f"row {ROW['id']!r} (agent {AGENT!r}): its prompt is {tokens} tokens, no fewer than the "
        "policy server's context of 2048 tokens (policy.max_total_sequence_length), which the "
        "policy server refuses (400 'maximum context length'), so it was not sent. Shorten the "
        "row's prompt (system prompt, tools and input all count) or raise the context"
    )


def test_a_prompt_that_cannot_be_measured_is_sent_and_the_reason_logged(tokenizer, caplog):
    """A measurement that fails (a row the template cannot render) is logged, not swallowed: the
    row is sent as it is and the policy server decides (the unreachable agent fails it here)."""

    def broken(row):
        raise ValueError("messages[0] has no role")

    size = PromptSize(broken, context_tokens=2048)
    unreachable = {AGENT: "http://127.0.0.1:9"}
    outcome = collect(unreachable, NemoGymPostprocessConfig(), ROW, 1, tokenizer, size)
    assert outcome.prompt_refused == "" and len(outcome.failures) == 1
    (warning,) = [
        r.getMessage() for r in caplog.records if "could not be measured" in r.getMessage()
    ]
    assert f"row {ROW['id']!r} (agent {AGENT!r})" in warning
    assert "ValueError: messages[0] has no role" in warning


def test_a_prompt_the_policy_server_refuses_is_named_from_the_result_and_not_retried(
    policy_url, tokenizer
):
    """Unmeasured (an agent may add to the prompt): the policy server refuses the first model
    call with a 400, the built-in agent ends the episode at the limit as Gym's vllm_model
    adapter does, and the collector names the refusal: no retry, no failure, no episode."""
    with start_agent(policy_url, send_token_ids=True) as env:
        outcome = collect(
            {AGENT: env.agent_url}, NemoGymPostprocessConfig(), _long_row(), 2, tokenizer
        )
    assert (outcome.episodes, outcome.failures, outcome.retries) == ([], [], 0)
    assert outcome.prompt_refused == (
        f"row {ROW['id']!r} (agent {AGENT!r}): the policy server refused the prompt, longer than "
        "its context (the first model call ended at the token limit with no token generated)"
    )


def test_the_failure_rate_lets_the_allowance_grow_with_the_run():
    """failure_budget=2, failure_rate=0.1: 12 failures in 100 episodes are within 2 + 10; the
    thirteenth is not. A budget of 2 alone would have stopped at the third."""
    budget = FailureBudget(limit=2, rate=0.1)
    for group in range(25):
        budget.record(["crashed"] * (group >= 13), episodes=4)  # the failures come late
    assert (budget.count, budget.episodes) == (12, 100)
    with pytest.raises(RolloutBudgetExceeded, match=r"13 of 104 episodes .* = 12\.4;"):
        budget.record(["crashed"], episodes=4)


def test_failures_counted_as_a_reward_never_stop_the_run():
    budget = FailureBudget(limit=0, charge=False)
    for _ in range(10):
        budget.record(["the environment answered 500"] * 4, episodes=4)
    assert budget.count == 40

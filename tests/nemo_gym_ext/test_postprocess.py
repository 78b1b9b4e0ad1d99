"""Tests of `postprocess_gym_result`: the contiguity contract (nemo_gym_ext/postprocess.py).

Episodes come from the `episode_builder` fixture (tests/nemo_gym_ext/conftest.py), which builds
them the way a Gym agent does and injects divergences the way re-rendering does. One test uses
the real SmolLM2 tokenizer to produce a genuine BPE-merge divergence and read its decoded window.
"""

from __future__ import annotations

import copy
import math

import pytest

from nemo_gym_ext.config import NemoGymPostprocessConfig
from nemo_gym_ext.postprocess import (
    MalformedGymResultError,
    NonContiguousEpisodeError,
    postprocess_gym_result,
)

STRICT = NemoGymPostprocessConfig()
TRUNCATE = NemoGymPostprocessConfig(truncate_noncontiguous_episodes=True)
MASK = NemoGymPostprocessConfig(on_malformed_result="mask")
BOTH_MODES = pytest.mark.parametrize("config", [STRICT, TRUNCATE], ids=["strict", "truncate"])


def _assert_retained(out, episode, retained: int) -> None:
    """`message_log` holds exactly the first `retained` trainable turns, tokens untouched."""
    log = out.message_log
    assert [entry["role"] for entry in log] == ["user", "assistant"] * retained
    for turn in range(retained):
        user, assistant = log[2 * turn], log[2 * turn + 1]
        assert user["token_ids"] == episode.delta(turn)
        assert assistant["token_ids"] == episode.generations[turn]
        assert assistant["generation_logprobs"] == episode.logprobs[turn]
    flattened = [token for entry in log for token in entry["token_ids"]]
    last = retained - 1
    assert flattened == episode.prompts[last] + episode.generations[last]


# --- default: a divergence is an error with a short, useful message ------------------------------


def test_default_raises_assertion_subclass_naming_agent_row_turn_and_position(
    episode_builder, divergence_at, turn_maker
):
    episode = episode_builder(
        turn_maker(1, 5),
        divergence=divergence_at(3, "substitute", position=20),
        agent="swe_agent",
        row_id="django-11099",
    )
    with pytest.raises(NonContiguousEpisodeError) as caught:
        postprocess_gym_result(episode.row, episode.result, STRICT)
    error = caught.value
    assert isinstance(error, AssertionError)
    assert (error.agent, error.row_id, error.turn, error.position) == (
        "swe_agent",
        "django-11099",
        3,
        20,
    )
    message = str(error)
    assert "'swe_agent'" in message
    assert "'django-11099'" in message
    assert "trainable turn 3" in message
    assert f"output item {episode.item_indices[3]}" in message
    assert "first difference at token 20" in message
    assert "truncate_noncontiguous_episodes" in message


@pytest.mark.parametrize(
    ("kind", "position"),
    [
        ("substitute", 2),  # inside turn 1's prompt
        ("substitute", 17),  # inside turn 1's generation (its prompt is 16 tokens long)
        ("insert", 13),  # window straddles turn 1's prompt and generation
        ("drop_generation", 0),  # the prompt is shorter than what was seen
    ],
)
def test_divergence_message_shows_both_windows(
    episode_builder, divergence_at, turn_maker, kind, position
):
    episode = episode_builder(turn_maker(2, 3), divergence=divergence_at(2, kind, position))
    with pytest.raises(NonContiguousEpisodeError) as caught:
        postprocess_gym_result(episode.row, episode.result, STRICT)
    found = caught.value.position
    assert found == episode.divergent_position
    start, stop = max(0, found - 8), found + 8
    message = str(caught.value)
    assert f"ids {episode.seen_before(2)[start:stop]}" in message
    assert f"ids {episode.prompts[2][start:stop]}" in message


def test_divergence_message_decodes_a_real_bpe_merge_divergence(tokenizer):
    """The sampler emitted ' pr' + 'int'; the server re-tokenised the text as ' print'."""
    header = "User: show the value\nAssistant:"
    first_prompt = tokenizer.encode(header, add_special_tokens=False)
    generation = tokenizer.convert_tokens_to_ids(["Ġpr", "int"]) + tokenizer.encode(
        "(value)", add_special_tokens=False
    )
    second_prompt = tokenizer.encode(
        header + " print(value)\nTool: 42\nAssistant:", add_special_tokens=False
    )
    assert second_prompt[: len(first_prompt)] == first_prompt
    result = {
        "id": "bpe-1",
        "agent_ref": {"type": "responses_api_agents", "name": "calculator"},
        "reward": 0.0,
        "response": {
            "output": [
                {
                    "type": "function_call",
                    "prompt_token_ids": first_prompt,
                    "generation_token_ids": generation,
                    "generation_log_probs": [-0.5] * len(generation),
                },
                {"type": "function_call_output", "output": "42"},
                {
                    "type": "message",
                    "prompt_token_ids": second_prompt,
                    "generation_token_ids": [2],
                    "generation_log_probs": [-0.1],
                },
            ]
        },
    }
    with pytest.raises(NonContiguousEpisodeError) as caught:
        postprocess_gym_result(result, result, STRICT, decode=tokenizer.decode)
    position = len(first_prompt)
    assert caught.value.position == position
    start, stop = position - 8, position + 8
    message = str(caught.value)
    seen_text = tokenizer.decode((first_prompt + generation)[start:stop])
    prompt_text = tokenizer.decode(second_prompt[start:stop])
    assert f"text {seen_text!r}" in message
    assert f"text {prompt_text!r}" in message
    assert "print(value)" in prompt_text


@pytest.mark.parametrize("with_decode", [False, True], ids=["ids", "ids+text"])
def test_divergence_message_stays_short_for_a_64k_token_prompt(
    episode_builder, divergence_at, turn_maker, tokenizer, with_decode
):
    long_first_turn = turn_maker(4, 1, delta_length=64_000, generation_length=120)[0]
    second_turn = turn_maker(3, 1, delta_length=200, generation_length=120)[0]
    episode = episode_builder(
        [long_first_turn, second_turn],
        divergence=divergence_at(1, "substitute", position=40_000),
    )
    assert len(episode.prompts[1]) > 64_000
    decode = tokenizer.decode if with_decode else None
    with pytest.raises(NonContiguousEpisodeError) as caught:
        postprocess_gym_result(episode.row, episode.result, STRICT, decode=decode)
    assert caught.value.position == 40_000
    assert len(str(caught.value)) < 2000


# --- truncation on: keep the contiguous prefix --------------------------------------------------


@pytest.mark.parametrize("divergent_turn", [1, 3, 5], ids=["first-possible", "middle", "last"])
@pytest.mark.parametrize("kind", ["substitute", "insert", "drop_generation"])
def test_truncation_keeps_exactly_the_prefix_before_the_divergent_turn(
    episode_builder, divergence_at, turn_maker, divergent_turn, kind
):
    episode = episode_builder(
        turn_maker(5, 6), divergence=divergence_at(divergent_turn, kind, position=7), reward=0.75
    )
    out = postprocess_gym_result(episode.row, episode.result, TRUNCATE)
    _assert_retained(out, episode, divergent_turn)
    full = out.full_result
    assert full["reward"] == 0.75
    assert full["noncontiguous_truncated"] is True
    assert full["noncontiguous_dropped_turns"] == 6 - divergent_turn
    assert out.overlong is False


@BOTH_MODES
@pytest.mark.parametrize("count", [1, 7])
def test_contiguous_episode_keeps_every_turn_and_flag_false(
    episode_builder, turn_maker, config, count
):
    episode = episode_builder(turn_maker(6, count), reward=1.0)
    out = postprocess_gym_result(episode.row, episode.result, config)
    _assert_retained(out, episode, count)
    assert out.full_result["noncontiguous_truncated"] is False
    assert out.full_result["noncontiguous_dropped_turns"] == 0
    assert out.full_result["reward"] == 1.0


@BOTH_MODES
def test_reused_result_dict_gets_stale_flags_reset(episode_builder, turn_maker, config):
    episode = episode_builder(
        turn_maker(7, 4),
        result_fields={
            "noncontiguous_truncated": True,
            "noncontiguous_dropped_turns": 3,
            "malformed_sample": True,
        },
    )
    full = postprocess_gym_result(episode.row, episode.result, config).full_result
    assert full["noncontiguous_truncated"] is False
    assert full["noncontiguous_dropped_turns"] == 0
    assert full["malformed_sample"] is False


def test_reprocessing_a_truncated_full_result_is_stable(episode_builder, divergence_at, turn_maker):
    """A `full_result` fed back in (a retried step) is truncated the same way, not doubled."""
    episode = episode_builder(turn_maker(8, 5), divergence=divergence_at(2))
    first = postprocess_gym_result(episode.row, episode.result, TRUNCATE)
    again = postprocess_gym_result(episode.row, first.full_result, TRUNCATE)
    assert again.message_log == first.message_log
    assert again.full_result["noncontiguous_dropped_turns"] == 3


def test_overlong_flag_survives_when_the_overlong_turn_was_dropped(
    episode_builder, divergence_at, turn_maker
):
    episode = episode_builder(
        turn_maker(9, 4), divergence=divergence_at(2), result_fields={"overlong": True}
    )
    out = postprocess_gym_result(episode.row, episode.result, TRUNCATE)
    assert out.full_result["noncontiguous_truncated"] is True
    assert out.overlong is True
    assert out.full_result["overlong"] is True


@BOTH_MODES
def test_overlong_defaults_to_false(episode_builder, turn_maker, config):
    episode = episode_builder(turn_maker(10, 2))
    assert postprocess_gym_result(episode.row, episode.result, config).overlong is False


@pytest.mark.parametrize(
    ("config", "divergent"),
    [(STRICT, False), (STRICT, True), (TRUNCATE, False), (TRUNCATE, True), (MASK, False)],
    ids=["strict", "strict-raises", "truncate", "truncate-divergent", "mask"],
)
def test_inputs_are_never_mutated(episode_builder, divergence_at, turn_maker, config, divergent):
    episode = episode_builder(
        turn_maker(11, 5),
        divergence=divergence_at(3) if divergent else None,
        result_fields={"noncontiguous_truncated": True, "overlong": True},
    )
    row_before, result_before = copy.deepcopy(episode.row), copy.deepcopy(episode.result)
    try:
        out = postprocess_gym_result(episode.row, episode.result, config, vocab_size=49152)
    except NonContiguousEpisodeError:
        assert config is STRICT and divergent
    else:
        for entry in out.message_log:
            entry["token_ids"].append(-7)
            entry.get("generation_logprobs", []).append(-7.0)
        out.result["reward"] = -1.0
    assert episode.row == row_before
    assert episode.result == result_before


def test_masked_malformed_result_does_not_mutate_inputs(episode_builder, turn_maker):
    episode = episode_builder(turn_maker(12, 3))
    episode.result["response"]["output"][episode.item_indices[1]]["generation_log_probs"][0] = 0.5
    row_before, result_before = copy.deepcopy(episode.row), copy.deepcopy(episode.result)
    out = postprocess_gym_result(episode.row, episode.result, MASK)
    out.result["reward"] = -1.0
    assert out.full_result["malformed_sample"] is True
    assert episode.row == row_before
    assert episode.result == result_before


@BOTH_MODES
def test_empty_generations_are_skipped_and_never_diverge(episode_builder, turn_maker, config):
    episode = episode_builder(turn_maker(13, 5), empty_generation_after={0, 2, 4})
    out = postprocess_gym_result(episode.row, episode.result, config)
    _assert_retained(out, episode, 5)
    assert out.full_result["noncontiguous_truncated"] is False


@BOTH_MODES
def test_items_without_token_fields_are_ignored(episode_builder, turn_maker, config):
    with_items = episode_builder(turn_maker(14, 4), non_token_items=True)
    without = episode_builder(turn_maker(14, 4), non_token_items=False)
    assert len(with_items.result["response"]["output"]) > len(without.result["response"]["output"])
    out = postprocess_gym_result(with_items.row, with_items.result, config)
    assert (
        out.message_log == postprocess_gym_result(without.row, without.result, config).message_log
    )
    _assert_retained(out, with_items, 4)


def test_divergence_in_the_dropped_tail_after_an_empty_generation(
    episode_builder, divergence_at, turn_maker
):
    """An empty-generation item between the last retained and the divergent turn changes nothing."""
    episode = episode_builder(
        turn_maker(15, 5), divergence=divergence_at(3, "insert", 4), empty_generation_after={2}
    )
    out = postprocess_gym_result(episode.row, episode.result, TRUNCATE)
    _assert_retained(out, episode, 3)
    assert out.full_result["noncontiguous_dropped_turns"] == 2


# --- malformed results --------------------------------------------------------------------------


def _item(result, episode, turn):
    return result["response"]["output"][episode.item_indices[turn]]


def _set_logprob(value):
    def mutate(result, episode):
        _item(result, episode, 1)["generation_log_probs"][2] = value

    return mutate


def _set_reward(value):
    def mutate(result, episode):
        result["reward"] = value

    return mutate


def _drop_response(result, episode):
    del result["response"]


def _drop_output(result, episode):
    del result["response"]["output"]


def _output_not_a_list(result, episode):
    result["response"]["output"] = {"0": result["response"]["output"][0]}


def _output_item_not_an_object(result, episode):
    result["response"]["output"].insert(1, "stray text")


def _drop_prompt(result, episode):
    del _item(result, episode, 2)["prompt_token_ids"]


def _empty_prompt(result, episode):
    _item(result, episode, 2)["prompt_token_ids"] = []


def _drop_logprobs(result, episode):
    del _item(result, episode, 1)["generation_log_probs"]


def _logprobs_too_short(result, episode):
    _item(result, episode, 1)["generation_log_probs"].pop()


def _generation_id_over_vocab(result, episode):
    _item(result, episode, 3)["generation_token_ids"][1] = 49152


def _prompt_id_over_vocab(result, episode):
    _item(result, episode, 3)["prompt_token_ids"][-1] = 10**9


def _negative_generation_id(result, episode):
    _item(result, episode, 3)["generation_token_ids"][0] = -1


def _negative_prompt_id(result, episode):
    _item(result, episode, 0)["prompt_token_ids"][0] = -5


def _drop_reward(result, episode):
    del result["reward"]


def _no_trainable_turn(result, episode):
    for index in episode.item_indices:
        item = result["response"]["output"][index]
        item["generation_token_ids"], item["generation_log_probs"] = [], []


MALFORMED_CASES = [
    pytest.param(_drop_response, "response.output", id="missing-response"),
    pytest.param(_drop_output, "response.output", id="missing-output"),
    pytest.param(_output_not_a_list, "response.output", id="output-not-a-list"),
    pytest.param(_output_item_not_an_object, "response.output[1]", id="item-not-an-object"),
    pytest.param(_drop_prompt, "prompt_token_ids", id="generation-without-prompt"),
    pytest.param(_empty_prompt, "prompt_token_ids", id="empty-prompt"),
    pytest.param(_drop_logprobs, "generation_log_probs", id="missing-logprobs"),
    pytest.param(_logprobs_too_short, "generation_log_probs", id="length-mismatch"),
    pytest.param(_set_logprob(math.nan), "generation_log_probs[2]", id="nan-logprob"),
    pytest.param(_set_logprob(math.inf), "generation_log_probs[2]", id="inf-logprob"),
    pytest.param(_set_logprob(-math.inf), "generation_log_probs[2]", id="minus-inf-logprob"),
    pytest.param(_set_logprob(0.7), "generation_log_probs[2]", id="positive-logprob"),
    pytest.param(_set_logprob("-0.1"), "generation_log_probs", id="string-logprob"),
    pytest.param(_generation_id_over_vocab, "generation_token_ids", id="generation-id-over-vocab"),
    pytest.param(_prompt_id_over_vocab, "prompt_token_ids", id="prompt-id-over-vocab"),
    pytest.param(_negative_generation_id, "generation_token_ids", id="negative-generation-id"),
    pytest.param(_negative_prompt_id, "prompt_token_ids", id="negative-prompt-id"),
    pytest.param(_set_reward(math.nan), "reward", id="nan-reward"),
    pytest.param(_set_reward(-math.inf), "reward", id="inf-reward"),
    pytest.param(_set_reward("1.0"), "reward", id="string-reward"),
    pytest.param(_set_reward(True), "reward", id="bool-reward"),
    pytest.param(_drop_reward, "reward", id="missing-reward"),
    pytest.param(_no_trainable_turn, "generation_token_ids", id="no-trainable-turn"),
]


@pytest.fixture
def well_formed(episode_builder, turn_maker):
    return episode_builder(turn_maker(16, 4), row_id="astropy-12907", reward=0.5)


@pytest.mark.parametrize(("mutate", "field"), MALFORMED_CASES)
@BOTH_MODES
def test_malformed_result_raises_naming_row_and_field(well_formed, mutate, field, config):
    result = copy.deepcopy(well_formed.result)
    mutate(result, well_formed)
    with pytest.raises(MalformedGymResultError) as caught:
        postprocess_gym_result(well_formed.row, result, config, vocab_size=49152)
    message = str(caught.value)
    assert "'astropy-12907'" in message
    assert field in message
    assert len(message) < 500


TOKEN_FIELD_CASES = [case for case in MALFORMED_CASES if case.values[1] != "reward"]
REWARD_CASES = [case for case in MALFORMED_CASES if case.values[1] == "reward"]


@pytest.mark.parametrize(("mutate", "field"), TOKEN_FIELD_CASES)
def test_masked_malformed_result_trains_on_nothing_and_keeps_the_reward(well_formed, mutate, field):
    result = copy.deepcopy(well_formed.result)
    mutate(result, well_formed)
    out = postprocess_gym_result(well_formed.row, result, MASK, vocab_size=49152)
    assert out.message_log == []
    full = out.full_result
    assert full["malformed_sample"] is True
    assert full["noncontiguous_truncated"] is False
    assert full["reward"] == 0.5


@pytest.mark.parametrize(("mutate", "field"), REWARD_CASES)
def test_a_result_without_a_usable_reward_is_never_masked(well_formed, mutate, field):
    """A masked sample still joins its GRPO group's baseline, so its reward must be finite."""
    result = copy.deepcopy(well_formed.result)
    mutate(result, well_formed)
    with pytest.raises(MalformedGymResultError, match="reward must be a finite number"):
        postprocess_gym_result(well_formed.row, result, MASK, vocab_size=49152)


def test_a_stock_result_without_agent_ref_takes_the_rows(well_formed):
    """Stock Gym servers drop unknown fields, `agent_ref` among them: the row routed the episode
    to its agent, so the row's agent_ref is stamped on the result, which is not mutated."""
    result = copy.deepcopy(well_formed.result)
    del result["agent_ref"]
    out = postprocess_gym_result(well_formed.row, result, STRICT, vocab_size=49152)
    assert out.full_result["agent_ref"] == well_formed.row["agent_ref"]
    assert "agent_ref" not in result


@pytest.mark.parametrize(
    ("row_ref", "result_ref", "message"),
    [
        (None, None, r"'astropy-12907': the row has no agent_ref\.name"),
        ({"name": "calculator"}, {}, r"'astropy-12907': the result has no agent_ref\.name"),
        ({"name": "calculator"}, {"name": ""}, r"the result has no agent_ref\.name"),
        ({"name": "calculator"}, {"name": "other"}, r"names agent 'other'.*sent to 'calculator'"),
    ],
)
def test_an_episode_without_one_agent_is_never_masked(well_formed, row_ref, result_ref, message):
    """The agent names the GRPO group and the metrics, so it is required even in mask mode."""
    row, result = copy.deepcopy(well_formed.row), copy.deepcopy(well_formed.result)
    row["agent_ref"], result["agent_ref"] = row_ref, result_ref
    with pytest.raises(MalformedGymResultError, match=message):
        postprocess_gym_result(row, result, MASK, vocab_size=49152)


def test_ids_over_vocab_pass_without_a_vocab_size(episode_builder, turn_maker):
    """The upper bound needs the tokenizer's size; without it only negative ids are rejected."""
    episode = episode_builder([([5, 60_000], [70_000]), ([1], [2])])
    out = postprocess_gym_result(episode.row, episode.result, STRICT)
    assert out.message_log[1]["token_ids"] == [70_000]


def test_last_id_of_the_vocabulary_is_accepted(episode_builder):
    episode = episode_builder([([0, 49151], [49151])])
    out = postprocess_gym_result(episode.row, episode.result, STRICT, vocab_size=49152)
    assert out.message_log[1]["token_ids"] == [49151]


@pytest.mark.parametrize(
    "bad_ids", [["token_id:11", "token_id:12"], [11.0, 12.0]], ids=["strings", "floats"]
)
def test_non_integer_ids_are_malformed(episode_builder, bad_ids):
    episode = episode_builder([([3, 4], [5, 6])])
    result = copy.deepcopy(episode.result)
    _item(result, episode, 0)["generation_token_ids"] = bad_ids
    with pytest.raises(MalformedGymResultError, match="generation_token_ids"):
        postprocess_gym_result(episode.row, result, STRICT, vocab_size=49152)


def test_huge_but_finite_logprobs_do_not_crash(episode_builder):
    episode = episode_builder([([3, 4], [5, 6])])
    result = copy.deepcopy(episode.result)
    _item(result, episode, 0)["generation_log_probs"] = [-1e308, -1e308]
    out = postprocess_gym_result(episode.row, result, STRICT)
    assert out.message_log[1]["generation_logprobs"] == [-1e308, -1e308]


@pytest.mark.parametrize(
    "logprobs",
    [
        [-0.1, math.nan],
        [-0.1, math.inf],
        [math.inf, -math.inf],
    ],
    ids=["nan", "inf", "inf-and-minus-inf"],
)
def test_non_finite_logprob_message_names_position_and_value(episode_builder, logprobs):
    episode = episode_builder([([3, 4], [5, 6])])
    result = copy.deepcopy(episode.result)
    _item(result, episode, 0)["generation_log_probs"] = logprobs
    with pytest.raises(MalformedGymResultError) as caught:
        postprocess_gym_result(episode.row, result, STRICT)
    bad = next(index for index, value in enumerate(logprobs) if not math.isfinite(value))
    assert f"generation_log_probs[{bad}] = {logprobs[bad]!r}" in str(caught.value)


def test_errors_survive_pickling_across_processes(episode_builder, divergence_at, turn_maker):
    """Ray carries an actor's exception to the driver by pickling it."""
    import pickle

    episode = episode_builder(turn_maker(9, 4), divergence=divergence_at(2))
    with pytest.raises(NonContiguousEpisodeError) as caught:
        postprocess_gym_result(episode.row, episode.result, STRICT)
    copied = pickle.loads(pickle.dumps(caught.value))
    assert isinstance(copied, NonContiguousEpisodeError)
    assert str(copied) == str(caught.value)
    assert (copied.agent, copied.row_id, copied.turn, copied.position) == (
        caught.value.agent,
        caught.value.row_id,
        caught.value.turn,
        caught.value.position,
    )
    malformed = MalformedGymResultError("row 'x': reward must be a finite number")
    assert str(pickle.loads(pickle.dumps(malformed))) == str(malformed)


def test_turns_and_generated_tokens_are_counted_for_any_agent(episode_builder, turn_maker):
    episode = episode_builder(turn_maker(21, 3), agent="stock", reward=1.0)
    full = postprocess_gym_result(
        episode.row, episode.result, NemoGymPostprocessConfig()
    ).full_result
    generations = [
        item["generation_token_ids"]
        for item in episode.result["response"]["output"]
        if item.get("generation_token_ids")
    ]
    assert full["trainable_turns"] == len(generations) == 3
    assert full["generated_tokens"] == sum(map(len, generations))

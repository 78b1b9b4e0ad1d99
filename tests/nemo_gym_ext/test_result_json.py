"""`loads_result`: an agent's `/run` answer parsed to exactly what a JSON parser returns, with
repeated prompt prefixes rebuilt from earlier prompts instead of parsed again."""

from __future__ import annotations

import itertools
import json
import math
import random

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_gym_ext.result_json import _mark_prompt_arrays, loads_result


def episode(prompts: list[list[int]], generations: list[list[int]]) -> dict:
    output: list[dict] = [{"type": "reasoning", "summary": []}]
    for turn, (prompt, generation) in enumerate(zip(prompts, generations, strict=True)):
        output.append(
            {
                "type": "function_call",
                "call_id": f"c{turn}",
                "prompt_token_ids": prompt,
                "generation_token_ids": generation,
                "generation_log_probs": [-0.5] * len(generation),
            }
        )
        output.append({"type": "function_call_output", "call_id": f"c{turn}", "output": "ok"})
    return {"id": "r", "response": {"output": output}, "reward": 1.0}


def growing(turns: int, *, alphabet: int, seed: int) -> dict:
    """Each prompt is the history (every earlier prompt and generation) plus a delta."""
    rng = random.Random(seed)
    history: list[int] = []
    prompts, generations = [], []
    for _ in range(turns):
        prompts.append(history + [rng.randrange(alphabet) for _ in range(rng.randint(0, 5))])
        generations.append([rng.randrange(alphabet) for _ in range(rng.randint(1, 4))])
        history = prompts[-1] + generations[-1]
    return episode(prompts, generations)


ENCODERS = {
    "orjson": orjson.dumps,
    "json.dumps": lambda value: json.dumps(value).encode(),
    "indented": lambda value: json.dumps(value, indent=2).encode(),
}


@pytest.mark.parametrize("encoder", sorted(ENCODERS))
def test_a_growing_episode_parses_to_the_same_value_with_prefixes_reused(encoder):
    result = growing(30, alphabet=49152, seed=1)
    raw = ENCODERS[encoder](result)
    parsed = loads_result(raw)
    assert parsed == result == orjson.loads(raw)
    _, continued = _mark_prompt_arrays(raw)
    assert sum(earlier is not None for earlier in continued.values()) == 29
    prompts = [item["prompt_token_ids"] for item in parsed["response"]["output"][1::2]]
    assert all(later[0] is earlier[0] for earlier, later in itertools.pairwise(prompts[2:]))
    later = list(prompts[6])
    prompts[5].append(-1)  # each item holds its own list
    assert prompts[6] == later


@settings(max_examples=200, deadline=None)
@given(
    alphabet=st.sampled_from([2, 11, 49152]),
    turns=st.integers(1, 12),
    seed=st.integers(0, 2**32 - 1),
    edits=st.lists(
        st.tuples(st.integers(0, 11), st.integers(0, 40), st.integers(-3, 99)), max_size=3
    ),
    encoder=st.sampled_from(sorted(ENCODERS)),
)
def test_any_episode_with_any_edits_parses_as_a_json_parser_would(
    alphabet, turns, seed, edits, encoder
):
    """Prompts changed in place (a divergence), cut short or extended by one digit: whatever
    the bytes, the value is the parser's."""
    result = growing(turns, alphabet=alphabet, seed=seed)
    items = result["response"]["output"][1::2]
    for turn, position, value in edits:
        prompt = items[turn % len(items)]["prompt_token_ids"]
        if value == 99:
            del prompt[position:]
        elif prompt:
            prompt[position % len(prompt)] = value * 10 if value > 0 else value
    raw = ENCODERS[encoder](result)
    assert loads_result(raw) == json.loads(raw)


@pytest.mark.parametrize(
    "raw",
    [
        # an element that only starts like the previous prompt's last one
        b'{"response": {"output": [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [1, 23]}]}}',
        # equal prompts, and an empty one
        b'{"response": {"output": [{"prompt_token_ids": [4]}, {"prompt_token_ids": [4]},'
        b' {"prompt_token_ids": []}, {"prompt_token_ids": [ ]}]}}',
        # prompt arrays outside response.output: the whole body is parsed instead
        b'{"prompt_token_ids": [1, 2], "response": {"output": [{"prompt_token_ids": [1, 2, 3]}]}}',
        # a repeated key: the parser keeps the last
        b'{"response": {"output": [{"prompt_token_ids": [1], "prompt_token_ids": [1, 2]}]}}',
        # the key's text inside a string, and a key ending in it
        b'{"response": {"output": [{"text": "\\"prompt_token_ids\\": [9]",'
        b' "x\\"prompt_token_ids": [1], "prompt_token_ids": [1, 5]}]}}',
        # not only integers
        b'{"response": {"output": [{"prompt_token_ids": [1.5, 2]},'
        b' {"prompt_token_ids": [1.5, 2, 3]}]}}',
        b'{"response": {"output": [{"prompt_token_ids": ["a", 1]}, {"prompt_token_ids": [[1]]}]}}',
        # a string that looks like a marker, sent by the agent
        b'{"response": {"output": [{"prompt_token_ids": ["\\u0000gymrl-prefix:0", 1]}]}}',
    ],
)
def test_awkward_bodies_parse_as_a_json_parser_would(raw):
    assert loads_result(raw) == json.loads(raw)


def test_nan_from_pythons_encoder_is_read_and_broken_json_is_an_error():
    result = growing(3, alphabet=5, seed=0)
    result["reward"] = float("nan")
    parsed = loads_result(json.dumps(result).encode())
    assert math.isnan(parsed["reward"])
    assert parsed["response"] == result["response"]
    with pytest.raises(ValueError):
        loads_result(orjson.dumps(growing(3, alphabet=5, seed=0))[:-2])

"""Where rows come from: the built-in agents of the typed agent specs, or a JSONL file."""

import json

import pytest

from gymrl.config.schema import DataConfig, SamplingConfig
from gymrl.data import load_rows
from nemo_gym_ext.config import build_gym_actor_config

SAMPLING = SamplingConfig(temperature=0.7, top_p=0.9)


def _actors(agents):
    return [build_gym_actor_config({"agents": agents}, router_replay_enabled=False)]


def test_builtin_agents_get_interleaved_rows_and_remote_agents_none():
    actors = _actors(
        {
            "calc": {"environment": "calculator"},
            "guess": {"environment": "guess_number"},
            "remote": {"url": "http://gym-head:8000/remote"},
        }
    )
    rows = load_rows(DataConfig(num_builtin_rows_per_agent=2), actors, SAMPLING, seed=0)
    assert [row["agent_ref"]["name"] for row in rows] == ["calc", "guess", "calc", "guess"]
    for row in rows:
        params = row["responses_create_params"]
        assert (params["temperature"], params["top_p"]) == (0.7, 0.9)


def test_only_remote_agents_need_a_jsonl():
    actors = _actors({"remote": {"url": "http://gym-head:8000/remote"}})
    with pytest.raises(ValueError, match="no agent is a built-in environment"):
        load_rows(DataConfig(), actors, SAMPLING, seed=0)


def test_a_jsonl_row_without_its_agent_is_refused_with_its_line(tmp_path):
    good = {"responses_create_params": {"input": "hi"}, "agent_ref": {"name": "remote"}}
    bad = {"responses_create_params": {"input": "hi"}, "agent_ref": {"type": "x"}}
    path = tmp_path / "rows.jsonl"
    path.write_text(f"{json.dumps(good)}\n\n{json.dumps(bad)}\n", encoding="utf-8")
    actors = _actors({"remote": {"url": "http://gym-head:8000/remote"}})
    with pytest.raises(ValueError, match=rf"{path}:3: the row has no agent_ref\.name"):
        load_rows(DataConfig(train_jsonl=str(path)), actors, SAMPLING, seed=0)
    path.write_text(json.dumps(good) + "\n", encoding="utf-8")
    (row,) = load_rows(DataConfig(train_jsonl=str(path)), actors, SAMPLING, seed=0)
    assert row["responses_create_params"] == {"input": "hi", "temperature": 0.7, "top_p": 0.9}

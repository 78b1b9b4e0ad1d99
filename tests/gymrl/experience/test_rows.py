"""Rows: built-in agents' rows or a JSONL file, the stream a checkpoint's position resumes,
sampling stamped on every row, and the errors a user sees for a bad rows file."""

import json

import pytest

from gymrl.config.schema.env import DataConfig
from gymrl.config.schema.generation import SamplingConfig
from gymrl.experience.rows import RowStream, UnservedAgentError, load_rows, load_validation_rows
from nemo_gym_ext.config import build_gym_actor_config

SAMPLING = SamplingConfig(temperature=0.7, top_p=0.9)


def _load(data, actors, sampling=SAMPLING, served=("remote",), seed=0):
    return load_rows(
        data, actors, sampling, seed=seed, served_agents=set(served), max_output_tokens=48
    )


def _actors(agents):
    return [
        build_gym_actor_config(
            {"agents": agents},
            source="builtin",
            router_replay_enabled=False,
            token_capture_enabled=False,
        )
    ]


def _ids(stream, count):
    return [stream.next()[1]["id"] for _ in range(count)]


def test_row_stream_goes_on_past_the_end_of_the_data_each_pass_reshuffled_by_seed():
    """The end of the data is no end of the run: pass 0 takes the rows in order, each later pass
    is every row once, in an order drawn from the seed and the pass number."""
    rows = [{"id": str(i)} for i in range(20)]
    passes = [_ids(stream, 20) for stream in [RowStream(rows, seed=7)] for _ in range(4)]
    assert passes[0] == [str(i) for i in range(20)]
    for later in passes[1:]:
        assert sorted(later, key=int) == passes[0]
    assert len({tuple(p) for p in passes}) == 4  # every pass in its own order
    assert _ids(RowStream(rows, seed=8), 40)[20:] != passes[1]  # another seed, another order


def test_row_stream_from_a_position_draws_what_an_uninterrupted_stream_draws_there():
    """What a resume relies on: the row at a position depends on (rows, seed, position) only."""
    rows = [{"id": str(i)} for i in range(7)]
    straight = _ids(RowStream(rows, seed=3), 30)
    resumed = RowStream(rows, position=17, seed=3)
    assert _ids(resumed, 13) == straight[17:]
    assert resumed.position == 30 and RowStream(rows, seed=3).index_of(17) == int(straight[17])


def test_jsonl_rows_get_the_sampling_temperature_the_trainer_uses(tmp_path):
    path = tmp_path / "rows.jsonl"
    row = {
        "id": "r",
        "responses_create_params": {"input": [], "temperature": 0.1},
        "agent_ref": {"name": "remote"},
    }
    path.write_text(json.dumps(row) + "\n\n")
    (loaded,) = load_rows(
        DataConfig(train_jsonl=str(path)),
        [],
        SAMPLING,
        seed=0,
        served_agents={"remote"},
        max_output_tokens=48,
    )
    assert loaded["responses_create_params"] == {
        "input": [],
        "temperature": 0.7,
        "top_p": 0.9,
        "max_output_tokens": 48,
    }
    assert row["responses_create_params"]["temperature"] == 0.1  # the input is not mutated


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json\n", "rows.jsonl:1: not valid JSON"),
        ('{"id": "no params"}\n', "rows.jsonl:1: a row must be an object"),
        ("", "no training rows"),
    ],
)
def test_a_bad_rows_file_names_the_line(tmp_path, content, message):
    path = tmp_path / "rows.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        _load(DataConfig(train_jsonl=str(path)), [], SamplingConfig())


def test_a_missing_rows_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl"):
        _load(DataConfig(train_jsonl=str(tmp_path / "missing.jsonl")), [], SamplingConfig())


def test_builtin_agents_get_interleaved_rows_and_remote_agents_none():
    actors = _actors(
        {
            "calc": {"environment": "calculator"},
            "guess": {"environment": "guess_number"},
            "remote": {"url": "http://gym-head:8000/remote"},
        }
    )
    rows = _load(DataConfig(num_builtin_rows_per_agent=2), actors)
    assert [row["agent_ref"]["name"] for row in rows] == ["calc", "guess", "calc", "guess"]
    for row in rows:
        params = row["responses_create_params"]
        assert (params["temperature"], params["top_p"]) == (0.7, 0.9)


def test_only_remote_agents_need_a_jsonl():
    actors = _actors({"remote": {"url": "http://gym-head:8000/remote"}})
    with pytest.raises(ValueError, match="no agent is a built-in environment"):
        _load(DataConfig(), actors)


def test_a_jsonl_row_without_its_agent_is_refused_with_its_line(tmp_path):
    good = {"responses_create_params": {"input": "hi"}, "agent_ref": {"name": "remote"}}
    bad = {"responses_create_params": {"input": "hi"}, "agent_ref": {"type": "x"}}
    path = tmp_path / "rows.jsonl"
    path.write_text(f"{json.dumps(good)}\n\n{json.dumps(bad)}\n", encoding="utf-8")
    actors = _actors({"remote": {"url": "http://gym-head:8000/remote"}})
    with pytest.raises(ValueError, match=rf"{path}:3: the row has no agent_ref\.name"):
        _load(DataConfig(train_jsonl=str(path)), actors)
    path.write_text(json.dumps(good) + "\n", encoding="utf-8")
    (row,) = _load(DataConfig(train_jsonl=str(path)), actors)
    assert row["responses_create_params"] == {
        "input": "hi",
        "temperature": 0.7,
        "top_p": 0.9,
        "max_output_tokens": 48,
    }


def test_rows_of_unserved_agents_are_listed_with_their_lines(tmp_path):
    lines = [
        {"responses_create_params": {"input": "hi"}, "agent_ref": {"name": name}}
        for name in ["served", "typo_agent", "served", "other", "typo_agent"]
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in lines), encoding="utf-8")
    with pytest.raises(UnservedAgentError) as raised:
        _load(DataConfig(train_jsonl=str(path)), [], served=["served"])
    message = str(raised.value)
    assert "'other' on line 4; 'typo_agent' on lines 2, 5." in message
    assert "Served: ['served']" in message


def test_validation_rows_are_held_out_the_same_for_every_seed_and_greedy_by_default():
    actors = _actors({"calc": {"environment": "calculator"}})
    data = DataConfig(num_builtin_rows_per_agent=64, num_builtin_val_rows_per_agent=32)
    by_seed = []
    for seed in (0, 1):
        train = _load(data, actors, seed=seed)
        held_out = load_validation_rows(
            data, actors, train, temperature=0.0, top_p=0.9, served_agents=["calc"]
        )
        assert len(held_out) == 32
        train_tasks = {row["question"] for row in train}
        assert not train_tasks & {row["question"] for row in held_out}
        params = held_out[0]["responses_create_params"]
        assert (params["temperature"], params["top_p"]) == (0.0, 1.0)  # top-p is moot
        by_seed.append([row["id"] for row in held_out])
    # Seeds are compared on (nearly) the same rows: only tasks a seed trains on differ.
    assert len(set(by_seed[0]) & set(by_seed[1])) >= 28


def test_validation_rows_sample_with_the_configured_temperature_and_top_p():
    actors = _actors({"calc": {"environment": "calculator"}})
    data = DataConfig(num_builtin_rows_per_agent=4, num_builtin_val_rows_per_agent=2)
    train = _load(data, actors)
    rows = load_validation_rows(
        data, actors, train, temperature=0.5, top_p=0.9, served_agents=["calc"]
    )
    sampling = {
        (r["responses_create_params"]["temperature"], r["responses_create_params"]["top_p"])
        for r in rows
    }
    assert sampling == {(0.5, 0.9)}


def test_too_few_distinct_held_out_tasks_is_an_error_naming_the_key():
    actors = _actors({"calc": {"environment": "calculator"}})
    data = DataConfig(num_builtin_rows_per_agent=8, num_builtin_val_rows_per_agent=100_000)
    train = _load(data, actors)
    with pytest.raises(ValueError, match=r"num_builtin_val_rows_per_agent=100000.*'calculator'"):
        load_validation_rows(
            data, actors, train, temperature=0.0, top_p=1.0, served_agents=["calc"]
        )


def test_validation_rows_come_from_val_jsonl_when_given(tmp_path):
    row = {"responses_create_params": {"input": "hi"}, "agent_ref": {"name": "remote"}}
    path = tmp_path / "val.jsonl"
    path.write_text(json.dumps(row) + "\n", encoding="utf-8")
    actors = _actors({"remote": {"url": "http://gym-head:8000/remote"}})
    (loaded,) = load_validation_rows(
        DataConfig(val_jsonl=str(path)),
        actors,
        [],
        temperature=0.0,
        top_p=1.0,
        served_agents=["remote"],
    )
    assert loaded["responses_create_params"] == {"input": "hi", "temperature": 0.0, "top_p": 1.0}


def test_held_out_rows_naming_unserved_agents_are_refused_with_their_lines(tmp_path):
    lines = [
        {"responses_create_params": {"input": "hi"}, "agent_ref": {"name": name}}
        for name in ["remote", "retired_agent"]
    ]
    path = tmp_path / "val.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in lines), encoding="utf-8")
    actors = _actors({"remote": {"url": "http://gym-head:8000/remote"}})
    with pytest.raises(UnservedAgentError) as raised:
        load_validation_rows(
            DataConfig(val_jsonl=str(path)),
            actors,
            [],
            temperature=0.0,
            top_p=1.0,
            served_agents=["remote"],
        )
    message = str(raised.value)
    assert message.startswith(f"env.data.val_jsonl = {str(path)!r}")
    assert "'retired_agent' on line 2." in message
    assert "Served: ['remote']" in message

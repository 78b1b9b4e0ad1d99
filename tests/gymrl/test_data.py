"""Rows: the stream a checkpoint's position resumes, sampling stamped on every row, and the
errors a user sees for a bad rows file."""

import json

import pytest

from gymrl.config.schema import DataConfig, SamplingConfig
from gymrl.data import RowStream, load_rows


def test_row_stream_cycles_from_its_position_and_counts_past_the_end():
    rows = [{"id": "a"}, {"id": "b"}, {"id": "c"}]
    stream = RowStream(rows, position=2)
    taken = [stream.next() for _ in range(4)]
    assert [(position, row["id"]) for position, row in taken] == [
        (2, "c"),
        (3, "a"),
        (4, "b"),
        (5, "c"),
    ]
    assert stream.position == 6  # what a checkpoint saves; resuming there continues the cycle


def test_jsonl_rows_get_the_sampling_temperature_the_trainer_uses(tmp_path):
    path = tmp_path / "rows.jsonl"
    row = {"id": "r", "responses_create_params": {"input": [], "temperature": 0.1}}
    path.write_text(json.dumps(row) + "\n\n")
    (loaded,) = load_rows(
        DataConfig(train_jsonl=str(path)), [], SamplingConfig(temperature=0.7, top_p=0.9), seed=0
    )
    assert loaded["responses_create_params"] == {"input": [], "temperature": 0.7, "top_p": 0.9}
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
        load_rows(DataConfig(train_jsonl=str(path)), [], SamplingConfig(), seed=0)


def test_a_missing_rows_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl"):
        load_rows(
            DataConfig(train_jsonl=str(tmp_path / "missing.jsonl")), [], SamplingConfig(), seed=0
        )

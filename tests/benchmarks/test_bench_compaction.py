"""The figures of `benchmarks/bench_compaction.py` from recorded metrics, without running Gym (the
bench itself runs six training runs): per-episode means over the steps, the trained share of the
generated tokens with the validation passes' tokens kept out, a run without compaction counted
as one segment per episode, and the validation reward at the start and the end."""

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_compaction.py"
AT = "train/math_advanced_calculations_simple_agent/"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_compaction", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(folder: Path, records: list[dict]) -> Path:
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def _step(compactions, segments, first, later, generated, trained, validation=0.0, **extra):
    record = {
        "rollout/episodes": 16,
        AT + "generated_tokens/mean": first,
        "ledger/generated_tokens": generated,
        "ledger/trained_tokens": trained,
        "ledger/untrained_tokens/validation": validation,
        **extra,
    }
    if compactions is not None:
        record |= {
            AT + "compactions/mean": compactions,
            AT + "compaction_segments/mean": segments,
            AT + "compaction_segment_tokens/mean": later,
        }
    return record


def test_a_compacting_run_is_summarised_per_episode_and_without_validation_tokens(bench, tmp_path):
    folder = _write(
        tmp_path / "run",
        [
            {"validation/reward/mean": 0.25, "ledger/untrained_tokens/validation": 500.0},
            _step(0.5, 1.5, 30.0, 10.0, 700.0, 600.0, validation=100.0),
            _step(1.0, 2.0, 40.0, 20.0, 500.0, 400.0, **{"validation/reward/mean": 0.5}),
        ],
    )
    figures = bench.summary(folder)
    assert figures["episodes"] == 32
    assert figures["compactions_per_episode"] == pytest.approx(0.75)
    assert figures["segments_per_episode"] == pytest.approx(1.75)
    assert figures["first_segment_tokens_per_episode"] == pytest.approx(35.0)
    assert figures["later_segment_tokens_per_episode"] == pytest.approx(15.0)
    # (600 + 400) trained of (700 - 100) + 500 generated for training.
    assert figures["trained_share_of_generated"] == pytest.approx(1000 / 1100)
    assert (figures["validation_start"], figures["validation_end"]) == (0.25, 0.5)


def test_a_run_without_compaction_has_one_segment_per_episode(bench, tmp_path):
    folder = _write(
        tmp_path / "run",
        [
            {"validation/reward/mean": 0.25},
            _step(None, None, 30.0, None, 480.0, 480.0, **{"validation/reward/mean": 0.25}),
        ],
    )
    figures = bench.summary(folder)
    assert figures["compactions_per_episode"] == 0.0
    assert figures["segments_per_episode"] == 1.0
    assert figures["later_segment_tokens_per_episode"] == 0.0
    assert figures["trained_share_of_generated"] == 1.0

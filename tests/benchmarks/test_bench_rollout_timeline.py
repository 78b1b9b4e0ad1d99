"""`benchmarks/bench_rollout_timeline.py`'s reading of an engine timeline, without the roles it
starts: what a window waited on (the engine's phases, its idle time while episodes ran, short
batches with and without a queue, episode-seconds between turns) from recorded iterations."""

import importlib.util
import sys
from pathlib import Path

import pytest

from gymrl.generation.torch.engine import EngineStep

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCHMARKS))  # the bench imports bench_roles beside it
    try:
        spec = importlib.util.spec_from_file_location(
            "bench_rollout_timeline", BENCHMARKS / "bench_rollout_timeline.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


def step(start, end, *, admitted=0, decoded=0, waiting=0, answered=0, prefill=0.0, rebuild=0.0):
    return EngineStep(
        start_s=start,
        end_s=end,
        admitted=admitted,
        decoded_rows=decoded,
        waiting=waiting,
        answered=answered,
        prefill_s=prefill,
        rebuild_s=rebuild,
        decode_s=end - start - prefill - rebuild,
    )


def test_a_window_is_split_into_engine_phases_idle_time_and_time_between_turns(bench):
    # Three episodes, two slots. 0-1 s: two admitted, one queued. 1-2 s: both decode, one ends.
    # 2-3 s: the queued one joins. 3-4 s: both end. 4-6 s: the engine idles while one episode
    # is between turns (its next request comes at 6 s). 6-7 s: its last turn.
    steps = [
        step(0.0, 1.0, admitted=2, decoded=2, waiting=1, prefill=0.5, rebuild=0.25),
        step(1.0, 2.0, decoded=2, waiting=1, answered=1),
        step(2.0, 3.0, admitted=1, decoded=2, waiting=0, prefill=0.25, rebuild=0.25),
        step(3.0, 4.0, decoded=2, answered=2),
        step(6.0, 7.0, admitted=1, decoded=1, answered=1, prefill=0.5),
    ]
    spans = [(0.0, 2.0), (0.0, 4.0), (0.0, 7.0)]
    figures = bench.window_figures(steps, spans, max_rows=2)
    assert figures["wall_s"] == 7.0
    assert figures["prefill_s"] == pytest.approx(1.25)
    assert figures["rebuild_s"] == pytest.approx(0.5)
    assert figures["decode_s"] == pytest.approx(5.0 - 1.75)
    assert figures["idle_s"] == pytest.approx(2.0)  # 4-6 s
    assert figures["decode_steps"] == 5
    assert figures["rows_per_decode_step"] == pytest.approx(9 / 5)
    assert figures["full_step_share"] == pytest.approx(4 / 5)
    assert figures["short_queue_empty_share"] == 1.0
    assert (figures["prefill_iterations"], figures["requests"]) == (3, 4)
    # Rows joined at 0, 2 and 6 s; the rows that left (1-2 s, 3-4 s) changed the batch of those
    # same iterations.
    assert figures["rebuilds"] == 3
    # Outside the engine: 2-3 s nobody (two decode, the third ended at 2 s); 3-4 s none;
    # 4-6 s one episode alive with nothing in the engine: 2 episode-seconds.
    assert figures["between_turns_row_s"] == pytest.approx(2.0)
    assert figures["between_turns_s_per_request"] == pytest.approx(0.5)
    assert figures["forwards"] == 8


def test_a_short_batch_with_requests_queued_is_not_counted_as_wanting_requests(bench):
    steps = [step(0.0, 1.0, admitted=1, decoded=1, waiting=3, prefill=0.5)]
    figures = bench.window_figures(steps, [(0.0, 1.0)] * 4, max_rows=4)
    assert figures["short_queue_empty_share"] == 0.0
    assert figures["idle_s"] == 0.0
    assert figures["between_turns_row_s"] == 0.0

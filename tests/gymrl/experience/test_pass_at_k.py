"""pass@k: the unbiased estimator against its definition (the chance that k episodes drawn
without replacement from a task's n hold a success), and the per-agent reduction."""

import itertools
import math

import pytest

from gymrl.experience.held_out import HeldOutEpisode
from gymrl.experience.pass_at_k import pass_at_k, pass_at_k_metrics


def _by_enumeration(n, c, k):
    """Share of the k-subsets of n episodes (the first c successes) that hold a success."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 4, 7])
def test_the_estimator_is_the_share_of_k_draws_that_hold_a_success(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(_by_enumeration(n, c, k), abs=1e-12)


def test_pass_at_1_is_the_success_rate_and_the_formula_holds_for_large_n():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    expected = 1 - math.comb(200 - 13, 50) / math.comb(200, 50)
    assert pass_at_k(200, 13, 50) == pytest.approx(expected, rel=1e-9)


def test_impossible_counts_are_refused():
    with pytest.raises(ValueError, match="n=2, c=3, k=1"):
        pass_at_k(2, 3, 1)
    with pytest.raises(ValueError, match="n=2, c=1, k=3"):
        pass_at_k(2, 1, 3)


def _episode(agent, row, sample, reward=None, failure=None):
    summary = None if failure else {"agent_ref": {"name": agent}, "reward": reward}
    return HeldOutEpisode(row, agent, sample, summary=summary, failure=failure)


def test_metrics_average_tasks_per_agent_at_the_threshold_and_skip_rows_short_of_k():
    episodes = [
        # calc row a: 1 of 4 reach the threshold 1.0 (0.9 does not); row b: none
        _episode("calc", "a", 0, 1.0),
        _episode("calc", "a", 1, 0.9),
        _episode("calc", "a", 2, 0.0),
        _episode("calc", "a", 3, 0.0),
        *(_episode("calc", "b", i, 0.0) for i in range(4)),
        # guess row c: 2 of 3 finished succeed, one failed: scored for k=1, not for k=4
        _episode("guess", "c", 0, 1.0),
        _episode("guess", "c", 1, 1.0),
        _episode("guess", "c", 2, 0.0),
        _episode("guess", "c", 3, failure="502"),
    ]
    metrics = pass_at_k_metrics(episodes, [4, 1], threshold=1.0, prefix="eval/")
    assert metrics["eval/calc/pass@1"] == pytest.approx((0.25 + 0.0) / 2)
    assert metrics["eval/calc/pass@4"] == pytest.approx((1.0 + 0.0) / 2)
    assert metrics["eval/calc/pass@4/rows"] == 2.0
    assert metrics["eval/guess/pass@1"] == pytest.approx(2 / 3)
    assert metrics["eval/guess/pass@1/rows"] == 1.0
    assert "eval/guess/pass@4" not in metrics
    assert metrics["eval/pass@1"] == pytest.approx((0.25 + 0.0 + 2 / 3) / 3)
    assert metrics["eval/pass@4"] == pytest.approx(0.5)
    lower = pass_at_k_metrics(episodes, [1], threshold=0.9, prefix="eval/")
    assert lower["eval/calc/pass@1"] == pytest.approx((0.5 + 0.0) / 2)

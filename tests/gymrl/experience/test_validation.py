"""A validation pass: every held-out row once, summarised per agent under `validation/` with the
training fields plus the reward's standard error; failures counted, deadlines kept. The runner is
an in-process stand-in for the Gym shards (the producer's seam); the pass through real shards is
in tests/recipes/test_smoke_run.py."""

import math
import time

import pytest

from gymrl.experience.validation import Validator, standard_error, validation_metrics
from nemo_gym_ext.postprocess import NonContiguousEpisodeError
from nemo_gym_ext.rollout import GroupOutcome


def _row(index, agent):
    return {"id": f"{agent}-{index}", "agent_ref": {"name": agent}, "reward_if_run": index % 2}


class Runner:
    """Groups finish at once (or never, with `hold`); `outcome_for(row)` decides each outcome."""

    def __init__(self, outcome_for, hold=False):
        self.agents = {"calc", "guess"}
        self.sizes, self.cancelled, self._rows = [], [], {}
        self._outcome_for, self._hold = outcome_for, hold

    def submit(self, agent, row, num_episodes):
        self.sizes.append(num_episodes)
        self._rows[len(self._rows)] = row
        return len(self._rows) - 1

    def finished(self, running, timeout_s):
        if self._hold:
            time.sleep(min(timeout_s, 0.01))
            return []
        return list(running)[:2]  # a few at a time, as groups finish in a run

    def outcome(self, group):
        return self._outcome_for(self._rows[group])

    def cancel(self, group):
        self.cancelled.append(group)


def _scored(row):
    result = {
        "agent_ref": row["agent_ref"],
        "reward": float(row["reward_if_run"]),
        "noncontiguous_truncated": False,
        "num_turns": 2,
        "text": "not a scalar",
    }
    return GroupOutcome(row["id"], row["agent_ref"]["name"], episodes=[{"full_result": result}])


def test_a_pass_runs_every_row_once_and_logs_the_training_fields_per_agent():
    rows = [_row(i, "calc") for i in range(4)] + [_row(i, "guess") for i in range(3)]
    runner = Runner(_scored)
    metrics = Validator(rows, runner, timeout_s=10).run()
    assert runner.sizes == [1] * 7  # one episode per row
    assert metrics["validation/calc/reward/mean"] == 0.5
    assert metrics["validation/guess/reward/mean"] == pytest.approx(1 / 3)
    assert metrics["validation/calc/reward/stderr"] == pytest.approx(standard_error([0, 1, 0, 1]))
    assert metrics["validation/guess/noncontiguous_truncated/mean"] == 0.0
    assert metrics["validation/calc/num_turns/max"] == 2.0
    assert metrics["validation/reward/mean"] == pytest.approx(3 / 7)
    assert metrics["validation/episodes"] == 7.0
    assert metrics["validation/failures"] == 0.0
    assert not any("text" in key for key in metrics)


def test_failed_episodes_are_counted_and_left_out_of_the_means():
    def outcome(row):
        if row["id"] == "calc-1":
            return GroupOutcome(row["id"], "calc", failures=["agent 'calc' failed: 502"])
        return _scored(row)

    metrics = Validator([_row(i, "calc") for i in range(3)], Runner(outcome), 10).run()
    assert metrics["validation/failures"] == 1.0
    assert metrics["validation/episodes"] == 2.0
    assert metrics["validation/calc/reward/mean"] == 0.0  # rows 0 and 2


def test_a_pass_that_misses_its_deadline_says_which_key_to_raise_and_cancels_the_rest():
    runner = Runner(_scored, hold=True)
    with pytest.raises(TimeoutError, match=r"2 of 2 episodes unfinished.*batch_timeout_s"):
        Validator([_row(0, "calc"), _row(1, "calc")], runner, timeout_s=0.05).run()
    assert sorted(runner.cancelled) == [0, 1]


def test_a_contiguity_error_stops_the_pass_and_cancels_what_is_still_running():
    def outcome(row):
        raise NonContiguousEpisodeError(
            "non-contiguous episode", agent="calc", row_id=row["id"], turn=1, position=3
        )

    runner = Runner(outcome)
    with pytest.raises(NonContiguousEpisodeError):
        Validator([_row(i, "calc") for i in range(4)], runner, timeout_s=10).run()
    assert sorted(runner.cancelled) == [1, 2, 3]


def test_standard_error_is_the_sample_std_over_root_n_and_undefined_below_two():
    assert standard_error([0.0, 1.0, 0.0, 1.0]) == pytest.approx(math.sqrt(1 / 3 / 4))
    assert math.isnan(standard_error([1.0]))
    assert math.isnan(validation_metrics([], failures=0)["validation/reward/mean"])

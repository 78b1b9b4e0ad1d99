"""A held-out pass: every held-out row `num_samples` times (once in training's validation),
summarised per agent with the training fields plus the reward's standard error; failures
counted, deadlines kept, a stop honoured; one record per episode for an eval. The runner is an
in-process stand-in for the Gym shards (the producer's seam); the pass through real shards is in
tests/recipes/test_smoke_run.py and tests/recipes/test_eval_entry.py."""

import math
import threading
import time

import pytest

from gymrl.experience.held_out import (
    HeldOutEpisode,
    HeldOutPass,
    HeldOutRowsRefusedError,
    Validator,
    held_out_metrics,
    ledger_metrics,
    standard_error,
)
from nemo_gym_ext.config import NemoGymPostprocessConfig
from nemo_gym_ext.postprocess import NonContiguousEpisodeError, postprocess_gym_result
from nemo_gym_ext.rollout import GroupOutcome


def validator(rows, runner, timeout_s, *, max_refused_share=0.1, **options) -> Validator:
    return Validator(rows, runner, timeout_s, max_refused_share=max_refused_share, **options)


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
        "overlong": row["id"].endswith("-0"),
        "num_turns": 2,
        "text": "not a scalar",
        "finish_reasons": ["length" if row["id"].endswith("-0") else "stop", "stop"],
        # One model call: a prompt of 3 tokens, then 2 generated ones.
        "response": {
            "output": [
                {
                    "type": "message",
                    "prompt_token_ids": [1, 2, 3],
                    "generation_token_ids": [5, 6],
                    "generation_log_probs": [-0.1, -0.2],
                }
            ]
        },
    }
    episode = postprocess_gym_result(row, result, NemoGymPostprocessConfig())
    return GroupOutcome(row["id"], row["agent_ref"]["name"], episodes=[episode])


def test_a_pass_runs_every_row_once_and_logs_the_training_fields_per_agent():
    rows = [_row(i, "calc") for i in range(4)] + [_row(i, "guess") for i in range(3)]
    runner = Runner(_scored)
    metrics = validator(rows, runner, timeout_s=10).run()
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

    metrics = validator([_row(i, "calc") for i in range(3)], Runner(outcome), 10).run()
    assert metrics["validation/failures"] == 1.0
    assert metrics["validation/episodes"] == 2.0
    assert metrics["validation/calc/reward/mean"] == 0.0  # rows 0 and 2


def test_a_pass_that_misses_its_deadline_says_which_key_to_raise_and_cancels_the_rest():
    runner = Runner(_scored, hold=True)
    with pytest.raises(TimeoutError, match=r"2 of 2 episodes unfinished.*batch_timeout_s"):
        validator([_row(0, "calc"), _row(1, "calc")], runner, timeout_s=0.05).run()
    assert sorted(runner.cancelled) == [0, 1]


def test_a_contiguity_error_stops_the_pass_and_cancels_what_is_still_running():
    def outcome(row):
        raise NonContiguousEpisodeError(
            "non-contiguous episode", agent="calc", row_id=row["id"], turn=1, position=3
        )

    runner = Runner(outcome)
    with pytest.raises(NonContiguousEpisodeError):
        validator([_row(i, "calc") for i in range(4)], runner, timeout_s=10).run()
    assert sorted(runner.cancelled) == [1, 2, 3]


def test_standard_error_is_the_sample_std_over_root_n_and_undefined_below_two():
    assert standard_error([0.0, 1.0, 0.0, 1.0]) == pytest.approx(math.sqrt(1 / 3 / 4))
    assert math.isnan(standard_error([1.0]))
    assert math.isnan(
        held_out_metrics(HeldOutPass((), True), prefix="validation/")["validation/reward/mean"]
    )


def test_k_samples_of_every_row_each_become_one_record_in_the_order_they_end():
    rows = [_row(0, "calc"), _row(1, "calc")]
    runner = Runner(_scored)
    records = []
    held_out = validator(rows, runner, timeout_s=10, num_samples=3, prefix="eval/").collect(
        lambda episode: records.append(episode.record())
    )
    assert held_out.complete
    assert runner.sizes == [1] * 6  # each sample is its own one-episode group
    assert sorted((r["row_id"], r["sample"]) for r in records) == [
        (row, sample) for row in ("calc-0", "calc-1") for sample in range(3)
    ]
    first = next(r for r in records if r["row_id"] == "calc-0")
    assert first == {
        "row_id": "calc-0",
        "agent": "calc",
        "sample": first["sample"],
        "reward": 0.0,
        "turns": 2,
        "trainable_turns": 1,
        "tokens": {"prompt": 3, "generated": 2},
        "finish_reasons": ["length", "stop"],
        "truncated": True,
        "truncation_causes": ["max_tokens"],
        "failure": None,
    }
    metrics = held_out_metrics(held_out, prefix="eval/")
    assert metrics["eval/episodes"] == 6.0
    assert metrics["eval/calc/reward/mean"] == 0.5


def test_the_ledger_counts_failures_truncation_and_tokens_per_agent():
    def outcome(row):
        if row["id"] == "guess-1":
            return GroupOutcome(row["id"], "guess", failures=["agent 'guess' failed: 502"])
        return _scored(row)

    rows = [_row(0, "calc"), _row(1, "calc"), _row(0, "guess"), _row(1, "guess")]
    held_out = validator(rows, Runner(outcome), 10, num_samples=2).collect()
    failed = [e for e in held_out.episodes if e.failure is not None]
    assert [(e.row_id, e.record()["failure"]) for e in failed] == [
        ("guess-1", "agent 'guess' failed: 502")
    ] * 2
    metrics = ledger_metrics(held_out.episodes, prefix="eval/")
    assert metrics["eval/guess/failures"] == 2.0
    assert metrics["eval/guess/failure_rate"] == 0.5
    assert metrics["eval/calc/failure_rate"] == 0.0
    assert metrics["eval/calc/truncated/mean"] == 0.5  # row 0 hit the token limit
    assert metrics["eval/calc/tokens/generated"] == 4 * 2
    assert metrics["eval/calc/tokens/prompt"] == 4 * 3
    assert metrics["eval/tokens/generated"] == 6 * 2


def test_a_stop_ends_the_pass_with_what_finished_and_cancels_the_rest():
    stop = threading.Event()
    runner = Runner(_scored)
    seen = []

    def on_episode(episode: HeldOutEpisode):
        seen.append(episode)
        stop.set()  # as SIGINT does, while groups are still running

    rows = [_row(i, "calc") for i in range(4)]
    held_out = validator(rows, runner, 10).collect(on_episode, stop=stop)
    assert not held_out.complete
    assert len(held_out.episodes) == len(seen) == 2  # the first poll's two groups
    assert sorted(runner.cancelled) == [2, 3]


def test_transcripts_are_kept_without_token_fields_when_asked():
    held_out = validator([_row(0, "calc")], Runner(_scored), 10, keep_transcripts=True).collect()
    (episode,) = held_out.episodes
    assert episode.record()["transcript"] == [{"type": "message"}]
    plain = validator([_row(0, "calc")], Runner(_scored), 10).collect()
    assert "transcript" not in plain.episodes[0].record()


def _refusing(*refused_ids):
    """Outcomes as the Gym shard gives them: the rows `refused_ids` refused, the others scored."""

    def outcome(row):
        if row["id"] in refused_ids:
            reason = f"row {row['id']}: its prompt (5000 tokens) is longer than the context"
            return GroupOutcome(row["id"], row["agent_ref"]["name"], prompt_refused=reason)
        return _scored(row)

    return outcome


def test_refused_rows_are_named_once_counted_and_left_out_of_the_means(caplog):
    rows = [_row(i, "calc") for i in range(10)]
    held_out = validator(rows, Runner(_refusing("calc-3")), 10, num_samples=2).collect()
    assert [(r.row_id, r.agent) for r in held_out.refused] == [("calc-3", "calc")]
    warnings = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(warnings) == 1
    assert "1 of 10 held-out rows" in warnings[0] and "calc-3 (calc): row calc-3" in warnings[0]
    metrics = held_out_metrics(held_out, prefix="validation/")
    assert metrics["validation/refused_rows"] == 1.0
    assert metrics["validation/rows"] == 9.0
    assert metrics["validation/episodes"] == 18.0


@pytest.mark.parametrize(
    ("refused", "share", "count"),
    [
        (("calc-0", "calc-1"), 0.1, "2 of 10"),
        (tuple(f"calc-{i}" for i in range(10)), 1.0, "10 of 10"),
    ],
)
def test_a_pass_with_too_many_refused_rows_fails_naming_the_share(refused, share, count):
    rows = [_row(i, "calc") for i in range(10)]
    with pytest.raises(HeldOutRowsRefusedError, match=count) as error:
        validator(rows, Runner(_refusing(*refused)), 10, max_refused_share=share).collect()
    assert "env.data.max_refused_held_out_share" in str(error.value)

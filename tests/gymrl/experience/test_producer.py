"""The rollout producer's credit and eviction accounting, with an in-process runner and the real
replay buffer: no Ray, no servers.

The producer may have `(step - first_step + 1 + lookahead) * prompts_per_step` groups delivered
(lookahead = max_trajectory_age_steps when async, 0 when sync), plus one per group the buffer
evicted; a group that comes back without a baseline (fewer than two episodes) uses no credit.
"""

import json
import threading
import time
from pathlib import Path

import pytest

from gymrl.algo.episode_rules import EpisodeRules
from gymrl.config.schema.grpo import DynamicSamplingConfig, GRPOConfig
from gymrl.config.schema.loss import EpisodeRulesConfig, LossConfig
from gymrl.experience.producer import ProducerCounts, RolloutProducer
from gymrl.experience.replay_buffer import ReplayBuffer
from gymrl.experience.rows import RowStream
from gymrl.run.progress import ProgressWatch
from nemo_gym_ext.config import NemoGymPostprocessConfig
from nemo_gym_ext.config_errors import ConfigError
from nemo_gym_ext.postprocess import postprocess_gym_result
from nemo_gym_ext.rollout import (
    FailureBudget,
    GroupOutcome,
    RolloutBudgetExceeded,
    UnknownAgentError,
)

AGENT = "calc_agent"
LIMIT = 8  # the per-call token limit of the soft overlong penalty
RULES = EpisodeRules(LossConfig(), default_limit_tokens=LIMIT)
COMPACTED = Path(__file__).resolve().parents[2] / "data" / "compaction" / "episodes.json"
GROUP_DEADLINE_S = 60.0  # what the no-progress watchdog would report as a group's deadline


def _episode(reward=1.0, agent=AGENT, *, generated=1, overlong=False):
    """A postprocessed episode of one model call: 2 prompt tokens, then `generated` tokens."""
    call = {
        "type": "message",
        "prompt_token_ids": [1, 2],
        "generation_token_ids": [3] * generated,
        "generation_log_probs": [-0.5] * generated,
    }
    result = {
        "agent_ref": {"name": agent},
        "reward": reward,
        "overlong": overlong,
        "response": {"output": [call]},
    }
    return postprocess_gym_result(result, result, NemoGymPostprocessConfig())


def _rows(n=64, agent=AGENT):
    return [
        {"id": f"r{i}", "agent_ref": {"name": agent}, "responses_create_params": {}}
        for i in range(n)
    ]


class FakeRunner:
    """Runs groups in-process: every group finishes at once with `outcome_for(row, size)` unless
    `hold` is set, in which case groups stay running until cancelled."""

    def __init__(self, outcome_for=None, hold=False):
        self.agents = {AGENT}
        self.submitted = []  # (row id, size) in submission order
        self.cancelled = []
        self._outcome_for = outcome_for or (lambda row, size: _outcome(row, size))
        self._hold = hold
        self._running = {}
        self._lock = threading.Lock()

    def submit(self, agent, row, num_episodes):
        with self._lock:
            handle = len(self.submitted)
            self.submitted.append((row["id"], num_episodes))
            self._running[handle] = (row, num_episodes)
            return handle

    def finished(self, running, timeout_s):
        if self._hold:
            time.sleep(min(timeout_s, 0.01))
            return []
        return list(running)

    def outcome(self, group):
        row, size = self._running.pop(group)
        return self._outcome_for(row, size)

    def cancel(self, group):
        self.cancelled.append(group)


def _outcome(row, size, *, failures=(), retries=0):
    return GroupOutcome(
        row_id=row["id"],
        agent=AGENT,
        episodes=[_episode(float(i)) for i in range(size)],
        failures=list(failures),
        retries=retries,
    )


def _grpo(*, async_enabled=True, max_age=1, prompts=2, dynamic_sampling=None):
    return GRPOConfig(
        num_steps=10,
        num_prompts_per_step=prompts,
        num_generations_per_prompt=3,
        async_enabled=async_enabled,
        max_trajectory_age_steps=max_age,
        batch_timeout_s=5.0,
        dynamic_sampling=dynamic_sampling or DynamicSamplingConfig(),
    )


def _eventually(predicate, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def _settled(runner, expected):
    """Wait for `expected` submissions, then check that no more follow shortly after."""
    _eventually(lambda: len(runner.submitted) >= expected)
    time.sleep(0.2)
    assert len(runner.submitted) == expected


@pytest.fixture
def started():
    """Start producers and stop them after the test, whatever happened."""
    producers = []

    def start(grpo, runner, buffer, *, first_step=0, failures=None, rows=None, loss=None):
        producer = RolloutProducer(
            grpo,
            RowStream(rows or _rows()),
            runner,
            buffer,
            first_step=first_step,
            failures=failures or FailureBudget(4),
            rules=EpisodeRules(loss or LossConfig(), default_limit_tokens=LIMIT),
            group_deadline_s=GROUP_DEADLINE_S,
        )
        producers.append(producer)
        producer.start()
        return producer

    yield start
    for producer in producers:
        producer.stop()


def _buffer(grpo):
    return ReplayBuffer(grpo.max_trajectory_age_steps, capacity_groups=64)


def test_async_runs_lookahead_steps_ahead_and_advances_one_step_per_refit(started):
    grpo, runner = _grpo(max_age=1, prompts=2), FakeRunner()
    buffer = _buffer(grpo)
    producer = started(grpo, runner, buffer)
    _settled(runner, 4)  # (0 + 1 + 1) * 2
    assert buffer.stats()["put"] == 4
    assert all(size == 3 for _, size in runner.submitted)
    producer.advance(1, evicted_total=0)
    _settled(runner, 6)
    assert producer.fatal is None


def test_sync_makes_exactly_one_steps_groups_per_step(started):
    grpo, runner = _grpo(async_enabled=False, max_age=3, prompts=2), FakeRunner()
    producer = started(grpo, runner, _buffer(grpo))
    _settled(runner, 2)
    producer.advance(1, evicted_total=0)
    _settled(runner, 4)


def test_groups_carry_the_weight_version_live_when_they_were_submitted(started):
    grpo, runner = _grpo(async_enabled=False, prompts=1), FakeRunner()
    buffer = _buffer(grpo)
    producer = started(grpo, runner, buffer)
    _settled(runner, 1)
    producer.advance(1, evicted_total=0)
    _settled(runner, 2)
    versions = [group.weight_version for group in buffer.get_batch(2, 1, timeout_s=1)]
    assert versions == [0, 1]


def test_evicted_groups_are_replaced(started):
    grpo, runner = _grpo(max_age=1, prompts=2), FakeRunner()
    buffer = _buffer(grpo)
    producer = started(grpo, runner, buffer)
    _settled(runner, 4)  # 4 groups of version 0
    buffer.get_batch(2, current_step=0, timeout_s=1)  # step 0 trains on two of them
    producer.advance(1, evicted_total=buffer.stats()["evicted_stale"])
    _settled(runner, 6)  # 2 more, version 1
    buffer.get_batch(2, current_step=2, timeout_s=1)  # step 2 evicts the two left of version 0
    evicted = buffer.stats()["evicted_stale"]
    assert evicted == 2
    producer.advance(2, evicted_total=evicted)
    # Credit (2 + 1 + 1) * 2 = 8, plus the 2 evicted groups that were never trained on.
    _settled(runner, 10)


def test_a_resumed_run_counts_credit_from_its_first_step(started):
    grpo, runner = _grpo(max_age=1, prompts=2), FakeRunner()
    producer = started(grpo, runner, _buffer(grpo), first_step=5)
    _settled(runner, 4)
    producer.advance(6, evicted_total=0)
    _settled(runner, 6)


def test_a_group_without_a_baseline_is_dropped_and_replaced(started):
    def outcome_for(row, size):
        first = row["id"] == "r0"
        return _outcome(row, 1 if first else size, failures=["boom"] * 2 if first else ())

    grpo, runner = _grpo(max_age=0, prompts=2), FakeRunner(outcome_for)
    buffer = _buffer(grpo)
    producer = started(grpo, runner, buffer)
    _settled(runner, 3)
    assert buffer.stats()["put"] == 2
    # The dropped group's one episode generated 1 token, which no step trains.
    assert producer.counts() == ProducerCounts(
        retries=0,
        dropped_groups=1,
        failures=2,
        untrained_tokens={(AGENT, "failed_or_masked"): 1},
    )
    assert producer.fatal is None


def test_retries_are_summed_and_each_group_carries_its_summaries_and_time(started):
    grpo = _grpo(max_age=0, prompts=2)
    runner = FakeRunner(lambda row, size: _outcome(row, size, retries=2))
    buffer = _buffer(grpo)
    producer = started(grpo, runner, buffer)
    _settled(runner, 2)
    assert producer.counts().retries == 4
    groups = buffer.get_batch(2, current_step=0, timeout_s=1)
    assert [group.group_id for group in groups] == ["r0#1", "r1#2"]
    assert groups[0].summaries[0] == {
        "reward": 0.0,
        "agent_ref": {"name": AGENT},
        "overlong": False,
        "noncontiguous_truncated": False,
        "noncontiguous_dropped_turns": 0,
        "malformed_sample": False,
        "trainable_turns": 1,
        "generated_tokens": 1,
        "longest_call_tokens": 1,
        "length_penalty": 0.0,
        "overlong_masked": False,
    }
    assert [len(group.summaries) for group in groups] == [3, 3]
    assert all(group.seconds >= 0 for group in groups)


def test_past_the_failure_budget_the_producer_stops_with_the_cause(started):
    grpo = _grpo(max_age=0, prompts=2)
    runner = FakeRunner(lambda row, size: _outcome(row, size, failures=["agent crashed"]))
    producer = started(grpo, runner, _buffer(grpo), failures=FailureBudget(1))
    _eventually(lambda: producer.fatal is not None)
    assert isinstance(producer.fatal, RolloutBudgetExceeded)
    assert "agent crashed" in str(producer.fatal)


def test_failures_counted_as_a_reward_never_stop_the_producer(started):
    """env.rollout.on_episode_error=reward: the same failures as above, past the same budget,
    are counted and the groups keep coming."""
    grpo = _grpo(max_age=0, prompts=2)
    runner = FakeRunner(lambda row, size: _outcome(row, size, failures=["the env answered 500"]))
    buffer = _buffer(grpo)
    producer = started(grpo, runner, buffer, failures=FailureBudget(1, charge=False))
    groups = buffer.get_batch(2, current_step=0, timeout_s=5)
    assert [group.failed_episodes for group in groups] == [1, 1]
    _eventually(lambda: producer.counts().failures >= 2)
    assert producer.fatal is None


@pytest.mark.parametrize("failed_reward", [None, 0.0])
def test_a_lone_survivor_keeps_its_group_when_failed_episodes_count_with_a_reward(
    started, failed_reward
):
    """One episode came back, two failed: with loss.episodes.failed_reward the failed ones are
    its baseline (docs/configuration.md, "What the episode is"); without, the group has none
    and another row replaces it."""
    grpo = _grpo(max_age=0, prompts=1)
    runner = FakeRunner(lambda row, size: _outcome(row, 1, failures=["crashed", "crashed"]))
    buffer = _buffer(grpo)
    loss = LossConfig(episodes=EpisodeRulesConfig(failed_reward=failed_reward))
    producer = started(grpo, runner, buffer, failures=FailureBudget(1000), loss=loss)
    if failed_reward is None:
        _eventually(lambda: producer.counts().dropped_groups >= 2)
        assert buffer.stats()["size"] == 0
        return
    (group,) = buffer.get_batch(1, current_step=0, timeout_s=5)
    assert (len(group.trajectories), group.failed_episodes) == (1, 2)
    assert producer.counts().dropped_groups == 0


@pytest.mark.parametrize(
    ("episodes_back", "last_progress"),
    [(0, "the watch started"), (1, "group r0#1 reached the replay buffer")],
)
def test_only_a_group_that_can_train_is_progress_for_the_watchdog(
    started, episodes_back, last_progress
):
    """env.rollout.on_episode_error=reward with a model none of whose episodes finishes (Gym's
    grl_sokoban answered every reply of a random model with 500): every group comes back failed,
    is dropped and replaced, so the run would spin without a step; the no-progress watchdog must
    see nothing in it. A lone survivor that failed_reward gives a baseline reaches the buffer:
    that is progress."""
    now = [0.0]
    watch = ProgressWatch(100.0, poll_s=0.01, clock=lambda: now[0])
    watch.start()
    try:
        grpo = _grpo(max_age=0, prompts=1)
        runner = FakeRunner(
            lambda row, size: _outcome(row, episodes_back, failures=["answered 500"] * 2)
        )
        buffer = _buffer(grpo)
        loss = LossConfig(episodes=EpisodeRulesConfig(failed_reward=0.0))
        failures = FailureBudget(1, charge=False)
        producer = started(grpo, runner, buffer, failures=failures, loss=loss)
        if episodes_back:
            _eventually(lambda: buffer.stats()["put"] == 1)
        else:
            _eventually(lambda: producer.counts().dropped_groups >= 3)
        now[0] += 101.0
        _eventually(lambda: watch.error is not None)
        assert f"last progress: {last_progress})" in str(watch.error)
        assert producer.fatal is None
    finally:
        watch.stop()


def test_a_row_for_an_agent_no_shard_serves_stops_the_run(started):
    grpo, runner = _grpo(), FakeRunner()
    producer = started(grpo, runner, _buffer(grpo), rows=_rows(agent="nobody"))
    _eventually(lambda: producer.fatal is not None)
    assert isinstance(producer.fatal, UnknownAgentError)
    assert "'nobody'" in str(producer.fatal) and AGENT in str(producer.fatal)
    assert runner.submitted == []


def test_a_group_error_stops_the_producer_and_cancels_the_groups_in_flight(started):
    def outcome_for(row, size):
        raise RuntimeError("a shard died")

    grpo, runner = _grpo(max_age=1, prompts=2), FakeRunner(outcome_for)
    producer = started(grpo, runner, _buffer(grpo))
    _eventually(lambda: producer.fatal is not None)
    assert str(producer.fatal) == "a shard died"
    producer.join(5)
    # The first group raised; the other three submitted with it were cancelled.
    assert sorted(runner.cancelled) == [1, 2, 3]


def test_stop_cancels_every_group_in_flight_and_ends_the_thread(started):
    grpo, runner = _grpo(max_age=1, prompts=2), FakeRunner(hold=True)
    producer = started(grpo, runner, _buffer(grpo))
    _settled(runner, 4)
    producer.stop()
    assert not producer.is_alive()
    assert sorted(runner.cancelled) == [0, 1, 2, 3]
    assert producer.fatal is None


def _train(producer, buffer, steps, prompts):
    """What gymrl/recipes/training.py does per step, less the training: take the step's batch,
    record the data state (before `advance`, as a checkpoint would), advance. Returns the row
    ids of each step's batch and the data state recorded at each step's end."""
    trained, states = [], []
    for step in steps:
        batch = buffer.get_batch(prompts, step, timeout_s=5.0)
        trained.append([group.trajectories[0].group_id.split("#")[0] for group in batch])
        states.append(producer.data_state())
        producer.advance(step + 1, buffer.stats()["evicted_stale"])
    return trained, states


def _producer(grpo, rows, runner, buffer, *, first_step=0):
    return RolloutProducer(
        grpo,
        rows,
        runner,
        buffer,
        first_step=first_step,
        failures=FailureBudget(4),
        rules=RULES,
        group_deadline_s=GROUP_DEADLINE_S,
    )


@pytest.mark.parametrize("async_enabled", [False, True], ids=["sync", "async"])
def test_a_resumed_run_draws_the_rows_in_flight_again_once_and_trains_the_same_rows_per_step(
    async_enabled,
):
    """A run stopped after step 3 (its producer stopped, groups in flight cancelled, as at a
    preemption) and resumed from the data state recorded then trains the same rows at every
    step as a run that never stopped. Async (lookahead 1): the rows drawn for step 4 and not
    yet trained are recorded as pending and drawn again first, each exactly once."""
    grpo, prompts, steps = _grpo(async_enabled=async_enabled, max_age=1, prompts=2), 2, 7

    def run(producer, buffer, span):
        producer.start()
        try:
            return _train(producer, buffer, span, prompts)
        finally:
            producer.stop()

    buffer = _buffer(grpo)
    straight, _ = run(
        _producer(grpo, RowStream(_rows(10)), FakeRunner(), buffer), buffer, range(steps)
    )

    buffer = _buffer(grpo)
    before, states = run(
        _producer(grpo, RowStream(_rows(10)), FakeRunner(), buffer), buffer, range(3)
    )
    checkpoint = states[-1]  # what step 3's checkpoint holds
    assert checkpoint.pending == ((6, 7) if async_enabled else ())
    buffer, runner = _buffer(grpo), FakeRunner()
    rows = RowStream(_rows(10), checkpoint.position, redraw=checkpoint.pending)
    after, _ = run(_producer(grpo, rows, runner, buffer, first_step=3), buffer, range(3, steps))

    assert before + after == straight
    redrawn = [f"r{p % 10}" for p in checkpoint.pending]
    submitted = [row_id for row_id, _ in runner.submitted]
    assert submitted[: len(redrawn)] == redrawn  # drawn again first
    assert all(submitted.count(row) == 1 for row in redrawn)  # ... and once
    first_pass = [[f"r{i}", f"r{i + 1}"] for i in range(0, 10, 2)]
    assert straight[:5] == first_pass  # then steps 5 and 6 train the reshuffled second pass


def test_producer_and_trainer_threads_hand_over_whole_groups(started):
    """The producer thread keeps delivering while the trainer's thread takes batches, reads the
    producer's totals and advances: every group arrives whole, and the totals it reads are
    never behind what it was handed."""
    grpo = _grpo(max_age=1, prompts=2)
    runner = FakeRunner(lambda row, size: _outcome(row, size, retries=1))
    buffer = _buffer(grpo)
    producer = started(grpo, runner, buffer)
    trained = []
    for step in range(25):
        groups = buffer.get_batch(2, current_step=step, timeout_s=5)
        counts = producer.counts()
        trained.extend(group.group_id for group in groups)
        assert all(len(g.trajectories) == len(g.summaries) == 3 for g in groups)
        assert counts.retries >= len(trained)  # one retry per group, counted before delivery
        producer.advance(step + 1, buffer.stats()["evicted_stale"])
    producer.stop()
    assert len(set(trained)) == len(trained) == 50
    assert producer.counts().retries == buffer.stats()["put"]


# ------------------------------------------------------------------------- dynamic sampling
def _uniform_every_other(row, size):
    """Rows r0, r2, r4, ... come back with one reward for every episode (nothing to learn)."""
    uniform = int(row["id"][1:]) % 2 == 0
    return GroupOutcome(
        row_id=row["id"],
        agent=AGENT,
        episodes=[_episode(1.0 if uniform else float(i)) for i in range(size)],
    )


@pytest.mark.parametrize("async_enabled", [False, True], ids=["sync", "async"])
def test_dynamic_sampling_replaces_uniform_groups_with_further_rows(started, async_enabled):
    sampling = DynamicSamplingConfig(enabled=True, max_dropped_groups_per_step=8)
    grpo = _grpo(async_enabled=async_enabled, prompts=2, dynamic_sampling=sampling)
    runner = FakeRunner(_uniform_every_other)
    buffer = _buffer(grpo)
    producer = started(grpo, runner, buffer)
    groups = buffer.get_batch(2, current_step=0, timeout_s=5)
    assert [g.group_id.split("#")[0] for g in groups] == ["r1", "r3"]
    _eventually(lambda: producer.counts().uniform_dropped.get(AGENT, 0) >= 2)
    assert producer.counts().uniform_over_budget == 0


def test_dynamic_sampling_stops_dropping_once_the_steps_budget_is_spent(started):
    sampling = DynamicSamplingConfig(enabled=True, max_dropped_groups_per_step=1)
    grpo = _grpo(async_enabled=False, prompts=2, dynamic_sampling=sampling)
    runner = FakeRunner(lambda row, size: _outcome_with_rewards(row, [1.0] * size))
    buffer = _buffer(grpo)
    producer = started(grpo, runner, buffer)
    groups = buffer.get_batch(2, current_step=0, timeout_s=5)  # does not wait forever
    assert [g.group_id.split("#")[0] for g in groups] == ["r1", "r2"]
    assert producer.counts().uniform_dropped == {AGENT: 1}
    assert producer.counts().uniform_over_budget == 2
    producer.advance(1, 0)  # a new step: a new budget
    buffer.get_batch(2, current_step=1, timeout_s=5)
    _eventually(lambda: producer.counts().uniform_dropped == {AGENT: 2})


def test_without_dynamic_sampling_uniform_groups_reach_the_step(started):
    grpo = _grpo(async_enabled=False, prompts=2)
    buffer = _buffer(grpo)
    producer = started(grpo, FakeRunner(_uniform_every_other), buffer)
    groups = buffer.get_batch(2, current_step=0, timeout_s=5)
    assert [g.group_id.split("#")[0] for g in groups] == ["r0", "r1"]
    assert producer.counts().uniform_dropped == {}


def _outcome_with_rewards(row, rewards, *, overlong=False, generated=1, failures=()):
    episodes = [_episode(reward, generated=generated, overlong=overlong) for reward in rewards]
    return GroupOutcome(row["id"], AGENT, episodes=episodes, failures=list(failures))


def test_the_soft_overlong_penalty_gives_a_uniform_group_variance(started):
    """Equal rewards, but one episode's call ran into the penalty's buffer: the group now
    teaches something (shorter is better), so dynamic sampling keeps it."""
    sampling = DynamicSamplingConfig(enabled=True)
    rules = EpisodeRulesConfig(overlong_penalty_buffer_tokens=4)
    grpo = _grpo(async_enabled=False, prompts=1, dynamic_sampling=sampling)

    def outcome(row, size):
        short = _outcome_with_rewards(row, [1.0] * (size - 1), generated=2)
        long = _outcome_with_rewards(row, [1.0], generated=6)  # 6 of LIMIT 8, buffer from 4
        return GroupOutcome(row["id"], AGENT, episodes=short.episodes + long.episodes)

    buffer = _buffer(grpo)
    producer = started(grpo, FakeRunner(outcome), buffer, loss=LossConfig(episodes=rules))
    (group,) = buffer.get_batch(1, current_step=0, timeout_s=5)
    assert [t.length_penalty for t in group.trajectories] == [0.0, 0.0, 0.5]
    assert [s["length_penalty"] for s in group.summaries] == [0.0, 0.0, 0.5]
    assert producer.counts().uniform_dropped == {}


def test_overlong_mask_drops_the_tokens_and_the_summary_says_so(started):
    loss = LossConfig(episodes_per_agent={AGENT: {"overlong_mask": True}})
    grpo = _grpo(async_enabled=False, prompts=1)
    runner = FakeRunner(lambda row, size: _outcome_with_rewards(row, [0.0, 1.0], overlong=True))
    buffer = _buffer(grpo)
    started(grpo, runner, buffer, loss=loss)
    (group,) = buffer.get_batch(1, current_step=0, timeout_s=5)
    assert all(t.is_masked and t.overlong for t in group.trajectories)
    assert [s["overlong_masked"] for s in group.summaries] == [True, True]


def test_groups_carry_their_failed_episodes(started):
    grpo = _grpo(async_enabled=False, prompts=1)
    runner = FakeRunner(
        lambda row, size: _outcome_with_rewards(row, [0.0, 1.0], failures=["timeout"])
    )
    buffer = _buffer(grpo)
    started(grpo, runner, buffer)
    (group,) = buffer.get_batch(1, current_step=0, timeout_s=5)
    assert group.failed_episodes == 1


def test_a_refused_prompt_is_counted_named_skipped_and_never_drawn_again(started, caplog):
    """The policy server refused row r1's prompt as longer than its context: the producer logs
    the collector's message once per refusal, counts the row, lets another row take its place
    and never submits r1 again, also in later passes over the data; no failure is counted."""
    refusal = "row 'r1' (agent 'calc_agent'): the policy server refused the prompt: 3100 tokens"

    def outcome_for(row, size):
        if row["id"] == "r1":
            return GroupOutcome(row_id="r1", agent=AGENT, prompt_refused=refusal)
        return _outcome(row, size)

    grpo, runner = _grpo(async_enabled=False, prompts=2), FakeRunner(outcome_for)
    buffer = _buffer(grpo)
    with caplog.at_level("WARNING", logger="gymrl.experience.producer"):
        producer = started(grpo, runner, buffer, rows=_rows(3))
        trained = []
        for step in range(4):  # four steps of two rows: about three passes over the three rows
            trained += [g.group_id.split("#")[0] for g in buffer.get_batch(2, step, 5.0)]
            producer.advance(step + 1, 0)
    submitted = [row_id for row_id, _ in runner.submitted]
    assert submitted.count("r1") == 1
    assert "r1" not in trained and len(trained) == 8
    counts = producer.counts()
    assert (counts.prompts_too_long, counts.failures) == (1, 0)
    assert [r.getMessage() for r in caplog.records] == [
        f"skipping row 1 for the rest of the run: {refusal}"
    ]


def test_a_run_whose_every_prompt_is_refused_stops_saying_so(started):
    grpo = _grpo(async_enabled=False, prompts=1)
    runner = FakeRunner(lambda row, size: GroupOutcome(row["id"], AGENT, prompt_refused="no room"))
    producer = started(grpo, runner, _buffer(grpo), rows=_rows(2))
    _eventually(lambda: producer.fatal is not None)
    assert "refused the prompt of every one of the 2 rows" in str(producer.fatal)


def _compacted_outcome(row, size):
    """Gym's compacted episode (three declared segments), `size` times."""
    result = json.loads(COMPACTED.read_text())["two_per_chunk"]
    result = {**result, "agent_ref": {"name": AGENT}}
    episode = postprocess_gym_result(result, result, NemoGymPostprocessConfig())
    return GroupOutcome(row_id=row["id"], agent=AGENT, episodes=[episode] * size, failures=[])


def test_a_compacted_episode_under_a_per_sequence_loss_stops_the_run_naming_the_key(started):
    """Whether an agent compacts shows only in its results: the producer refuses the loss that
    would weigh a compacted episode once per segment when the first one arrives."""
    grpo = _grpo(max_age=0, prompts=2)
    loss = LossConfig(token_level_normalization=False)
    producer = started(grpo, FakeRunner(_compacted_outcome), _buffer(grpo), loss=loss)
    _eventually(lambda: producer.fatal is not None)
    assert isinstance(producer.fatal, ConfigError)
    (issue,) = producer.fatal.issues
    assert issue.key == "loss.token_level_normalization" and issue.value is False
    assert AGENT in issue.problem and "once per segment" in issue.problem


def test_a_compacted_episode_under_the_token_level_loss_reaches_the_buffer_whole(started):
    grpo = _grpo(max_age=0, prompts=2)
    buffer = _buffer(grpo)
    producer = started(grpo, FakeRunner(_compacted_outcome), buffer)
    groups = buffer.get_batch(2, current_step=0, timeout_s=5.0)
    assert producer.fatal is None
    for group in groups:  # three episodes of three sequences each, one summary per episode
        assert [t.segment for t in group.trajectories] == [0, 1, 2] * 3
        assert [summary["compactions"] for summary in group.summaries] == [2, 2, 2]

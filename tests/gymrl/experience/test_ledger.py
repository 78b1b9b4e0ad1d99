"""The token ledger: every generated token of a step, trained or not and why, from the real
postprocessor, episode rules, replay buffer and rollout producer (no Ray, no servers)."""

from __future__ import annotations

import pytest

from gymrl.algo.episode_rules import EpisodeRules
from gymrl.algo.trajectory import Trajectory
from gymrl.config.schema.grpo import DynamicSamplingConfig
from gymrl.config.schema.loss import EpisodeRulesConfig, LossConfig
from gymrl.experience.ledger import UNTRAINED_CAUSES, TokenLedger
from gymrl.experience.producer import RolloutProducer
from gymrl.experience.replay_buffer import ReplayBuffer
from gymrl.experience.rollout_group import RolloutGroup, scalar_fields
from gymrl.experience.rows import RowStream
from nemo_gym_ext.config import NemoGymPostprocessConfig
from nemo_gym_ext.postprocess import postprocess_gym_result
from nemo_gym_ext.rollout import FailureBudget, GroupOutcome
from tests.gymrl.experience.test_producer import FakeRunner, _buffer, _grpo, _settled
from tests.support.metric_docs import documented_patterns

TRUNCATE = NemoGymPostprocessConfig(
    truncate_noncontiguous_episodes=True, on_malformed_result="mask"
)
MASK_OVERLONG = EpisodeRules(
    LossConfig(episodes=EpisodeRulesConfig(overlong_mask=True)), default_limit_tokens=64
)


def gym_result(agent, generations, *, diverge_at=(), reward=1.0, **fields):
    """A Gym result of one model call per generation; at each turn of `diverge_at` the history
    is re-tokenised (its first id changes), so truncation drops that turn and the rest."""
    output, history = [], []
    for turn, generation in enumerate(generations):
        if turn in diverge_at:
            history = [history[0] + 1, *history[1:]]
        prompt = [*history, 7, 8]
        output.append(
            {
                "type": "message",
                "prompt_token_ids": prompt,
                "generation_token_ids": generation,
                "generation_log_probs": [-0.5] * len(generation),
            }
        )
        history = prompt + generation
    return {
        "id": f"{agent}-{len(generations)}-{diverge_at}",
        "agent_ref": {"name": agent},
        "reward": reward,
        "response": {"output": output},
        **fields,
    }


def postprocessed(result, config=TRUNCATE):
    return postprocess_gym_result(result, result, config)


def group_of(results, group_id, *, version=0, rules=MASK_OVERLONG, config=TRUNCATE):
    """The group the producer makes of `results`: each episode, then its tail segments."""
    episodes = [postprocessed(result, config) for result in results]
    trajectories = []
    for e in episodes:
        head = Trajectory.from_postprocessed(e, group_id=group_id, weight_version=version)
        tails = Trajectory.segments_from_postprocessed(e, group_id=group_id, weight_version=version)
        trajectories += [rules.shape(t) for t in (head, *tails)]
    summaries = [scalar_fields(e.full_result) for e in episodes]
    return RolloutGroup.of(trajectories, summaries, seconds=1.0)


def test_a_steps_tokens_add_up_by_cause_per_agent_and_overall():
    malformed = gym_result("calc", [[1, 2]])
    malformed["response"]["output"][0]["generation_log_probs"] = [0.5, -0.5]  # positive
    trained = group_of(
        [
            gym_result("calc", [[1, 2, 3], [4, 5, 6, 7]]),  # 7 trained
            # 5 trained, 8 dropped:
            gym_result("calc", [[1] * 5, [2] * 6, [3] * 2], diverge_at=(1,)),
            gym_result("calc", [[9] * 4], overlong=True),  # 4 overlong-filtered
            malformed,  # masked: its malformed tokens count 0
        ],
        "calc#1",
    )
    buffer = ReplayBuffer(max_trajectory_age_steps=1, capacity_groups=4)
    buffer.put(
        group_of(
            [
                gym_result(
                    "guess",
                    [[1] * 10],
                )
            ]
            * 2,
            "g#1",
        ),
        1.0,
    )
    buffer.put(group_of([gym_result("guess", [[1, 1], [2] * 3], diverge_at=(1,))] * 2, "g#2"), 1.0)
    with pytest.raises(TimeoutError):
        buffer.get_batch(1, current_step=2, timeout_s=0.01)  # both groups are too old now
    validation = postprocessed(gym_result("guess", [[5] * 3, [6] * 4], diverge_at=(1,)))

    ledger = TokenLedger()
    ledger.trained_groups([trained])
    ledger.running_totals("buffer", buffer.evicted_tokens())
    ledger.validation_pass([scalar_fields(validation.full_result)])
    metrics = ledger.take()

    calc = {cause: metrics[f"ledger/calc/untrained_tokens/{cause}"] for cause in UNTRAINED_CAUSES}
    assert metrics["ledger/calc/trained_tokens"] == 12
    nothing = dict.fromkeys(UNTRAINED_CAUSES, 0.0)
    assert calc == {
        **nothing,
        "dropped_tail": 8,
        "overlong_filtered": 4,
    }
    assert metrics["ledger/calc/generated_tokens"] == 24
    guess = {cause: metrics[f"ledger/guess/untrained_tokens/{cause}"] for cause in UNTRAINED_CAUSES}
    assert guess == {
        **nothing,
        "stale": 20 + 4,
        "dropped_tail": 6,
        "validation": 3 + 4,  # its dropped tail too
    }
    assert metrics["ledger/guess/trained_tokens"] == 0
    assert metrics["ledger/generated_tokens"] == 24 + 37
    assert metrics["ledger/trained_tokens"] == 12
    for cause in UNTRAINED_CAUSES:
        assert metrics[f"ledger/untrained_tokens/{cause}"] == calc[cause] + guess[cause]
    patterns = documented_patterns()
    assert [key for key in metrics if not any(p.match(key) for p in patterns)] == []

    # The next record holds only what happened since: a running total counts its increase.
    ledger.running_totals("buffer", buffer.evicted_tokens())
    assert ledger.take() == {}


def test_the_producer_counts_the_tokens_of_the_groups_it_drops():
    """Dynamic sampling drops a group whose rewards are all equal; a group left with one episode
    (the others failed) has no baseline: both were generated and are never trained."""

    def outcome(row, size):
        if row["id"] == "r0":  # one reward for all: teaches nothing
            results = [gym_result("calc", [[1] * 3]) for _ in range(size)]
            return GroupOutcome(row["id"], "calc", [postprocessed(r) for r in results])
        if row["id"] == "r1":  # one episode came back, with a truncated tail
            result = gym_result("calc", [[1] * 2, [2] * 5], diverge_at=(1,), reward=0.0)
            return GroupOutcome(row["id"], "calc", [postprocessed(result)], ["timeout"] * 2)
        results = [gym_result("calc", [[1]], reward=float(i)) for i in range(size)]
        return GroupOutcome(row["id"], "calc", [postprocessed(r) for r in results])

    grpo = _grpo(
        async_enabled=False,
        prompts=1,
        dynamic_sampling=DynamicSamplingConfig(enabled=True, max_dropped_groups_per_step=4),
    )
    runner = FakeRunner(outcome)
    runner.agents = {"calc"}
    rows = [{"id": f"r{i}", "agent_ref": {"name": "calc"}} for i in range(8)]
    producer = RolloutProducer(
        grpo,
        RowStream(rows),
        runner,
        _buffer(grpo),
        first_step=0,
        failures=FailureBudget(4),
        rules=EpisodeRules(LossConfig(), default_limit_tokens=64),
        group_deadline_s=60.0,
    )
    producer.start()
    try:
        _settled(runner, 3)
        assert producer.fatal is None  # r0 dropped, r1 dropped, r2 delivered: the step's one group
        assert producer.counts().untrained_tokens == {
            ("calc", "no_variance"): 3 * 3,
            ("calc", "failed_or_masked"): 2,
            ("calc", "dropped_tail"): 5,
        }
    finally:
        producer.stop()


SPLIT = NemoGymPostprocessConfig(
    truncate_noncontiguous_episodes=True, split_noncontiguous_segments=1
)


def test_tail_segments_train_with_their_episodes_advantage_and_the_baseline_counts_it_once():
    rules = EpisodeRules(LossConfig(), default_limit_tokens=64)
    diverging = gym_result("calc", [[1] * 2, [2] * 3, [3] * 4, [4] * 5], diverge_at=(1, 3))
    results = [diverging, gym_result("calc", [[5] * 2], reward=0.0)]
    split_group = group_of(results, "s#1", rules=rules, config=SPLIT)
    dropped_group = group_of(results, "s#1", rules=rules)
    assert [t.segment for t in split_group.trajectories] == [0, 1, 0]
    assert split_group.episodes == dropped_group.trajectories
    assert split_group.trajectories[1].num_generated_tokens == 3 + 4
    with_segments = rules.advantages(split_group.trajectories, {})
    without = rules.advantages(dropped_group.trajectories, {})
    assert with_segments.tolist() == [without[0], without[0], without[1]]
    assert without[0] > 0 > without[1]

    ledger = TokenLedger()
    ledger.trained_groups([split_group])
    metrics = ledger.take()
    assert metrics["ledger/calc/trained_tokens"] == 2 + 3 + 4 + 2
    assert metrics["ledger/calc/untrained_tokens/dropped_tail"] == 5  # after the one segment
    assert metrics["ledger/calc/generated_tokens"] == 16
    summary = split_group.summaries[0]
    assert summary["noncontiguous_segments"] == 1
    assert summary["noncontiguous_segment_tokens"] == 7


def test_a_group_cannot_start_with_a_tail_segment():
    group = group_of([gym_result("calc", [[1], [2]], diverge_at=(1,))] * 2, "g", config=SPLIT)
    segment = group.trajectories[1]
    with pytest.raises(ValueError, match="starts with a tail segment"):
        RolloutGroup.of([segment, group.trajectories[0]], group.summaries[:1], seconds=1.0)

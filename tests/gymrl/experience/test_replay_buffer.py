"""Replay buffer: age bound, serving order, deadlines and concurrent producers/consumers."""

import threading

import pytest

from gymrl.algo.trajectory import Trajectory
from gymrl.experience.replay_buffer import ReplayBuffer
from gymrl.experience.rollout_group import RolloutGroup


def _trajectories(group_id, weight_version, size=2):
    return [
        Trajectory([1, 2], [0, 1], [0.0, -1.0], float(i), "agent", group_id, weight_version)
        for i in range(size)
    ]


def _group(group_id, weight_version, size=2):
    trajectories = _trajectories(group_id, weight_version, size)
    return RolloutGroup.of(trajectories, [{"reward": t.reward} for t in trajectories], seconds=1.0)


def _ids(batch):
    return [group.group_id for group in batch]


def test_serves_oldest_weight_version_first_then_in_arrival_order():
    buffer = ReplayBuffer(max_trajectory_age_steps=5, capacity_groups=8)
    for group_id, version in [("a", 2), ("b", 1), ("c", 2), ("d", 1), ("e", 3)]:
        assert buffer.put(_group(group_id, version), timeout_s=0.2)
    assert _ids(buffer.get_batch(3, current_step=3, timeout_s=0.2)) == ["b", "d", "a"]
    assert _ids(buffer.get_batch(2, current_step=3, timeout_s=0.2)) == ["c", "e"]


def test_a_group_is_as_old_as_its_oldest_trajectory():
    buffer = ReplayBuffer(max_trajectory_age_steps=1, capacity_groups=4)
    trajectories = _trajectories("mixed", 3) + _trajectories("mixed", 1)
    mixed = RolloutGroup.of(trajectories, [{}] * len(trajectories), seconds=1.0)
    assert mixed.weight_version == 1
    buffer.put(mixed, timeout_s=0.2)
    buffer.put(_group("fresh", 3), timeout_s=0.2)
    assert _ids(buffer.get_batch(1, current_step=3, timeout_s=0.2)) == ["fresh"]
    assert buffer.stats()["evicted_stale"] == 1


def test_stale_groups_are_evicted_and_counted():
    buffer = ReplayBuffer(max_trajectory_age_steps=1, capacity_groups=8)
    for group_id, version in [("v0", 0), ("v1", 1), ("v2", 2)]:
        buffer.put(_group(group_id, version), timeout_s=0.2)
    # Step 2 accepts weight versions >= 1: v0 is evicted.
    assert _ids(buffer.get_batch(1, current_step=2, timeout_s=0.2)) == ["v1"]
    # A group arriving already too old is counted as evicted and not stored.
    assert buffer.put(_group("late", 0), timeout_s=0.2) is False
    assert buffer.stats() == {"put": 4, "served": 1, "evicted_stale": 2, "size": 1}


def test_get_batch_deadline_names_what_was_missing():
    buffer = ReplayBuffer(max_trajectory_age_steps=2, capacity_groups=4)
    buffer.put(_group("only", 5), timeout_s=0.2)
    with pytest.raises(TimeoutError, match=r"only 1 of the 3 groups needed for step 6") as error:
        buffer.get_batch(3, current_step=6, timeout_s=0.2)
    assert "weight_version >= 4" in str(error.value)
    assert "max_trajectory_age_steps=2" in str(error.value)
    assert buffer.stats()["size"] == 1  # a failed wait takes nothing


def test_put_deadline_when_full():
    buffer = ReplayBuffer(max_trajectory_age_steps=2, capacity_groups=1)
    buffer.put(_group("first", 0), timeout_s=0.2)
    with pytest.raises(TimeoutError, match=r"replay buffer full \(1 groups\).*'second'"):
        buffer.put(_group("second", 0), timeout_s=0.2)
    assert buffer.stats() == {"put": 1, "served": 0, "evicted_stale": 0, "size": 1}


def test_a_blocked_put_whose_group_went_stale_meanwhile_is_dropped():
    buffer = ReplayBuffer(max_trajectory_age_steps=0, capacity_groups=1)
    buffer.put(_group("held", 1), timeout_s=0.2)
    results = []
    producer = threading.Thread(
        target=lambda: results.append(buffer.put(_group("old", 0), timeout_s=5.0))
    )
    producer.start()
    assert _ids(buffer.get_batch(1, current_step=1, timeout_s=0.2)) == ["held"]
    producer.join(timeout=5.0)
    assert results == [False]
    assert buffer.stats()["size"] == 0


def test_concurrent_producers_and_consumer():
    buffer = ReplayBuffer(max_trajectory_age_steps=10, capacity_groups=3)
    errors = []

    def produce(prefix):
        try:
            for i in range(10):
                buffer.put(_group(f"{prefix}{i}", 0), timeout_s=5.0)
        except Exception as error:  # surfaced through `errors` below
            errors.append(error)

    producers = [threading.Thread(target=produce, args=(p,)) for p in "xy"]
    for thread in producers:
        thread.start()
    served = []
    for _ in range(10):
        served.extend(_ids(buffer.get_batch(2, current_step=0, timeout_s=5.0)))
    for thread in producers:
        thread.join(timeout=5.0)
    assert not errors
    assert sorted(served) == sorted(f"{p}{i}" for p in "xy" for i in range(10))
    for prefix in "xy":  # each producer's groups come out in the order it put them
        mine = [int(g[1:]) for g in served if g[0] == prefix]
        assert mine == sorted(mine)
    assert buffer.stats() == {"put": 20, "served": 20, "evicted_stale": 0, "size": 0}


def test_invalid_arguments_are_named():
    buffer = ReplayBuffer(max_trajectory_age_steps=1, capacity_groups=2)
    with pytest.raises(ValueError, match=r"num_groups must be in \[1, capacity_groups=2\]"):
        buffer.get_batch(3, current_step=0, timeout_s=0.2)
    with pytest.raises(ValueError, match="timeout_s must be a finite number > 0"):
        buffer.get_batch(1, current_step=0, timeout_s=float("inf"))
    with pytest.raises(ValueError, match="capacity_groups"):
        ReplayBuffer(max_trajectory_age_steps=1, capacity_groups=0)


def test_a_rollout_group_is_one_group_with_a_summary_per_episode():
    two = _trajectories("a", 0) + _trajectories("b", 0)
    with pytest.raises(ValueError, match=r"several groups \['a', 'b'\]"):
        RolloutGroup.of(two, [{}] * 4, seconds=1.0)
    with pytest.raises(ValueError, match="empty group"):
        RolloutGroup.of([], [], seconds=1.0)
    with pytest.raises(ValueError, match="1 summaries for 2 trajectories"):
        RolloutGroup.of(_trajectories("a", 0), [{}], seconds=1.0)


def test_a_rollout_group_keeps_copies_of_what_it_was_built_from():
    trajectories = _trajectories("a", 0)
    summaries = [{"reward": 0.0}, {"reward": 1.0}]
    group = RolloutGroup.of(trajectories, summaries, seconds=2.0)
    summaries[0]["reward"] = 5.0
    trajectories.clear()
    assert [s["reward"] for s in group.summaries] == [0.0, 1.0]
    assert len(group.trajectories) == 2
    with pytest.raises(AttributeError):
        group.seconds = 3.0  # frozen

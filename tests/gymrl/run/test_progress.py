"""The no-progress watchdog (gymrl/run/progress.py) on its own: when it trips, what it reports
of each role's wait, and that the waits of the run (gymrl.cluster.ray_calls.wait_for and the
producer) end within a slice once it tripped."""

import threading
import time

import pytest

from gymrl.run import progress
from gymrl.run.progress import NoProgressError, ProgressWatch


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_it_trips_only_after_the_timeout_without_progress_and_names_every_roles_wait():
    clock = Clock()
    watch = ProgressWatch(300.0, clock=clock)
    entered, leave = threading.Event(), threading.Event()

    def producer():
        with watch.waiting("4 group(s) in flight, the oldest r7#3", 1850.0, since=clock() - 20):
            entered.set()
            leave.wait(5.0)

    thread = threading.Thread(target=producer, name="rollout-producer")
    thread.start()
    entered.wait(5.0)
    try:
        with (
            watch.waiting("step 3's 4 groups from the replay buffer", 1800.0),
            watch.waiting("buffer get_batch", 65.0),  # inner: not the one reported
        ):
            clock.now += 299.0
            watch.check()
            assert watch.error is None
            watch.progressed("group r5#2 reached the replay buffer")
            clock.now += 299.0
            watch.check()
            assert watch.error is None  # progress restarted the count
            clock.now += 1.0
            watch.check()
    finally:
        leave.set()
        thread.join(5.0)
    assert isinstance(watch.error, NoProgressError)
    assert str(watch.error) == (
        "no group of episodes reached training, no validation episode came back and no step "
        "advanced for 300.0 s (run.progress_timeout_s=300; last progress: group r5#2 reached the "
        "replay buffer). At that moment: rollout-producer: waiting for 4 "
        "group(s) in flight, the oldest r7#3 for 619.0 s (its deadline 1850 s); trainer loop: "
        "waiting for step 3's 4 groups from the replay buffer for 599.0 s (its deadline 1800 s)"
    )
    with pytest.raises(NoProgressError):
        watch.raise_if_stalled()


def test_a_role_between_waits_is_reported_busy():
    clock = Clock()
    watch = ProgressWatch(10.0, clock=clock)
    with watch.waiting("a train step", 1800.0):
        pass
    clock.now += 10.0
    watch.check()
    assert str(watch.error).endswith("At that moment: trainer loop: not waiting (busy)")


def test_a_wait_reworded_as_it_narrows_is_reported_in_its_last_words_since_its_start():
    """A call to many ranks says which have not answered yet (gymrl.cluster.ray_calls)."""
    clock = Clock()
    watch = ProgressWatch(10.0, clock=clock)
    with watch.waiting("train_step from ranks 0-3 (of 4)", 1800.0) as retitle:
        clock.now += 4.0
        with watch.waiting("an inner call", 5.0):
            retitle("train_step from rank 2 (of 4)")  # the outer one, not the innermost
        clock.now += 6.0
        watch.check()
    assert str(watch.error).endswith(
        "trainer loop: waiting for train_step from rank 2 (of 4) for 10.0 s (its deadline 1800 s)"
    )


def test_without_an_active_watch_the_module_functions_do_nothing():
    assert progress._active is None
    progress.progressed("nothing watches")
    with progress.waiting("anything", 1.0):
        progress.raise_if_stalled()


def test_a_started_watch_stops_a_wait_in_slices_within_a_slice():
    """The watch thread trips on its own; a role waiting in slices (as `wait_for` does) raises
    at its next check; the watch is the process's active one only while started."""
    watch = ProgressWatch(0.3, poll_s=0.05)
    watch.start()
    try:
        started = time.monotonic()
        with (
            pytest.raises(NoProgressError, match="trainer loop: waiting for a batch"),
            progress.waiting("a batch", 60.0),
        ):
            while True:
                progress.raise_if_stalled()
                time.sleep(0.05)
        assert time.monotonic() - started < 5.0
    finally:
        watch.stop()
    assert progress._active is None


def test_the_timeout_must_be_positive():
    with pytest.raises(ValueError, match="progress_timeout_s must be > 0"):
        ProgressWatch(0.0)

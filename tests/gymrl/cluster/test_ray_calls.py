"""wait_for on a real local Ray: deadlines, and the actor's own exception."""

import signal
import time

import pytest
import ray

from gymrl.cluster.ray_calls import wait_for
from gymrl.run.stop import StopRequested, stop_request_behind
from nemo_gym_ext.postprocess import NonContiguousEpisodeError

pytestmark = pytest.mark.usefixtures("local_ray")


@ray.remote(num_cpus=0)
def slow(seconds):
    time.sleep(seconds)
    return seconds


@ray.remote(num_cpus=0)
def diverging():
    raise NonContiguousEpisodeError("turn 3 diverged", agent="a", row_id="r", turn=3, position=7)


def test_a_result_within_the_deadline_is_returned():
    assert wait_for(slow.remote(0.0), timeout_s=30, what="a quick task") == 0.0


def test_a_missed_deadline_names_what_was_waited_for():
    with pytest.raises(TimeoutError, match=r"^the engine refit did not finish within 0.2 s$"):
        wait_for(slow.remote(5.0), timeout_s=0.2, what="the engine refit")


def test_the_actor_exception_arrives_as_itself():
    with pytest.raises(NonContiguousEpisodeError) as raised:
        wait_for(diverging.remote(), timeout_s=30, what="a group")
    assert (raised.value.turn, raised.value.position) == (3, 7)
    assert str(raised.value) == "turn 3 diverged"


def test_a_signal_handler_s_exception_leaves_a_long_wait_within_a_slice():
    """The stop deadline (a SIGALRM whose handler raises) must not wait for the whole timeout:
    inside `ray.get` the handler's exception only comes out when the call returns."""

    def on_alarm(signum, _frame):
        raise StopRequested(signum, step_finished=False, reason="deadline")

    saved = signal.signal(signal.SIGALRM, on_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.0)
        started = time.monotonic()
        with pytest.raises(BaseException) as raised:
            wait_for(slow.remote(60.0), timeout_s=60, what="a long step")
        waited = time.monotonic() - started
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, saved)
    assert stop_request_behind(raised.value) is not None
    assert waited < 10, f"the stop request waited {waited:.0f} s, for the whole timeout"

"""`close_actor` on a real local Ray: an actor ends whether its own `close()` works, fails or
hangs, and the caller hears why when it did not close cleanly."""

import time

import pytest
import ray
from ray.exceptions import RayActorError

from gymrl.cluster.ray_calls import close_actor

pytestmark = pytest.mark.usefixtures("local_ray")


@ray.remote(num_cpus=0)
class Holder:
    """Stands for a role that owns something its close() must release."""

    def __init__(self, close_behaviour: str):
        self._close_behaviour = close_behaviour

    def ping(self) -> str:
        return "pong"

    def close(self) -> None:
        if self._close_behaviour == "raise":
            raise RuntimeError("the server would not stop")
        if self._close_behaviour == "hang":
            time.sleep(60)


def _is_dead(actor, grace_s: float = 20.0) -> bool:
    """`ray.kill` returns before the process is gone: dead once a call fails with the actor's
    death within the grace (a call that merely times out is a busy actor, not a dead one)."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=2)
        except RayActorError:
            return True
        except ray.exceptions.GetTimeoutError:
            continue
        time.sleep(0.2)
    return False


def test_a_clean_close_then_the_process_ends():
    actor = Holder.remote("ok")
    assert ray.get(actor.ping.remote()) == "pong"
    close_actor(actor, timeout_s=10)
    assert _is_dead(actor)


def test_a_failing_close_is_reported_and_the_actor_still_ends():
    actor = Holder.remote("raise")
    with pytest.raises(RuntimeError, match="would not stop"):
        close_actor(actor, timeout_s=10)
    assert _is_dead(actor)


def test_a_hanging_close_hits_its_deadline_and_the_actor_still_ends():
    actor = Holder.remote("hang")
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="closing an actor"):
        close_actor(actor, timeout_s=0.5)
    assert time.monotonic() - started < 10
    assert _is_dead(actor)


def test_without_a_deadline_the_actor_is_killed_without_asking():
    actor = Holder.remote("hang")
    close_actor(actor)
    assert _is_dead(actor)

"""The SGLang server group's waits on its servers' actors (`gymrl.generation.sglang.servers`), on
a real local Ray with stand-in servers: under test is how the group waits, not SGLang
(tests/gymrl/generation/sglang/test_real_server.py runs the real one). A bare `ray.get` said
"GetTimeoutError: Get timed out: some object(s) not ready" and named no call, server or
deadline; and a stop that timed out left every server's actor alive."""

import sys
import time

import pytest
import ray
from ray.exceptions import RayActorError

from gymrl.cluster.placement import RolePlacement
from gymrl.config.schema.generation import SGLangGenerationConfig
from gymrl.generation.sglang import servers

pytestmark = pytest.mark.usefixtures("local_ray")
# Ray sends this module's stand-in by value: its workers' path does not hold the tests' folders.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

HANG_S = 600.0
HANGING_SERVER = 1  # its seed: the group gives server i the seed `seed + i`


class StandInServer:
    """A server's actor: answers at once, except server 1, which hangs where it is told to."""

    def __init__(self, generation, policy, *, model_path, seed, log_path, adapters):
        self.index, self.hangs_in = seed, model_path

    def url(self):
        self._maybe_hang("url")
        return f"http://server-{self.index}"

    def stop(self):
        self._maybe_hang("stop")

    def _maybe_hang(self, call):
        if self.index == HANGING_SERVER and self.hangs_in == call:
            time.sleep(HANG_S)


def _ended(actors, within_s: float = 30.0) -> None:
    """Every actor is dead within `within_s`. `ray.kill` returns before the actor dies: on a
    loaded machine a call sent right after it was still answered, so each actor is asked until
    it answers with its death."""
    deadline = time.monotonic() + within_s
    for actor in actors:
        while True:
            try:
                ray.get(actor.url.remote(), timeout=max(deadline - time.monotonic(), 0.1))
            except RayActorError:
                break
            assert time.monotonic() < deadline, (
                f"{actor} still answers {within_s:g} s after its kill"
            )
            time.sleep(0.5)


def _group(monkeypatch, hangs_in: str) -> servers.SGLangServerGroup:
    monkeypatch.setattr(servers, "SGLangServerActor", StandInServer)
    monkeypatch.setattr(servers, "START_MARGIN_S", 0.0)
    return servers.SGLangServerGroup(
        SGLangGenerationConfig(num_engines=2, server_start_timeout_s=5.0),
        None,  # pyright: ignore[reportArgumentType]  (the stand-in reads no policy)
        model_path=hangs_in,
        seed=0,
        log_dir="/nonexistent",
        placement_group=None,
        engines=RolePlacement(gpus_per_actor=0.0, cpus_per_actor=0.01),
    )


def test_a_server_that_never_starts_is_named_with_the_call_and_its_deadline(monkeypatch):
    created = []
    monkeypatch.setattr(servers.SGLangServerGroup, "_kill_actors", _recording(created))
    started = time.monotonic()
    with pytest.raises(TimeoutError) as raised:
        _group(monkeypatch, hangs_in="url")
    assert 5.0 <= time.monotonic() - started < 20.0
    assert str(raised.value) == (
        "the SGLang servers' start (generation.server_start_timeout_s + 0 s) did not finish "
        "within 5 s: no answer from SGLang server 1 (of 2)"
    )
    assert len(created) == 2
    _ended(created)


def _recording(created: list):
    """`_kill_actors`, also keeping the actors it ends (a group that failed to start is not
    returned, so the test cannot reach them otherwise)."""
    kill = servers.SGLangServerGroup._kill_actors

    def kill_and_record(group) -> None:
        created.extend(group._actors)
        kill(group)

    return kill_and_record


def test_a_stop_that_outlives_its_deadline_is_named_and_every_actor_is_still_ended(monkeypatch):
    group = _group(monkeypatch, hangs_in="stop")
    assert group.urls == ["http://server-0", "http://server-1"]
    # 5 s, here and for the start: on a loaded machine the answering server's actor took more
    # than 1-2 s to be scheduled, and was named with the hanging one.
    with pytest.raises(
        TimeoutError,
        match=r"stopping the SGLang servers did not finish within "
        r"5 s: no answer from SGLang server 1 \(of 2\)",
    ):
        group.shutdown(timeout_s=5.0)
    _ended(group._actors)

"""The rollout side of the fault matrix (docs/reliability.md): a real agent process that dies,
hangs, or answers garbage, against the real `RolloutCollector` over loopback HTTP.

For each fault the episode is retried within its budget and then reported as a failure with its
cause (counted against `env.rollout.failure_budget`), or the run is stopped with one message
(a result that is not a Gym result); it never stalls past its deadlines and never yields an
episode to train on. Each test prints its measured time to the failure (`-s` shows it).
"""

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_gym_ext.config import NemoGymPostprocessConfig
from nemo_gym_ext.envs.registry import make_rows
from nemo_gym_ext.postprocess import MalformedGymResultError
from nemo_gym_ext.rollout import RolloutCollector, RolloutSettings

AGENT = "calculator_agent"
ROW = make_rows("calculator", 1, seed=0, agent_name=AGENT)[0]
FAULTY_AGENT = Path(__file__).with_name("faulty_agent.py")
RUN_TIMEOUT_S, RETRIES = 3.0, 1
SETTINGS = RolloutSettings(
    max_concurrent_rollouts=4,
    run_timeout_s=RUN_TIMEOUT_S,
    max_retries=RETRIES,
    max_result_bytes=10 * 1024 * 1024,
    retry_backoff_s=0.05,
    retry_backoff_max_s=2.0,
    server_stops_divergences=False,
)


class FaultyAgent:
    """`faulty_agent.py MODE` as a child process; killed (and reaped) on exit."""

    def __init__(self, mode: str, tmp_path: Path):
        port_file = tmp_path / f"{mode}.port"
        self.process = subprocess.Popen([sys.executable, str(FAULTY_AGENT), mode, str(port_file)])
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text()):
            assert self.process.poll() is None, "the faulty agent exited during start-up"
            assert time.monotonic() < deadline, "the faulty agent did not start within 60 s"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port_file.read_text()}"

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        if self.process.poll() is None:
            self.kill()


def _run_group(url: str, episodes: int = 2, *, kill_after_s: float | None = None, agent=None):
    async def go():
        collector = RolloutCollector({AGENT: url}, NemoGymPostprocessConfig(), SETTINGS)
        try:
            if kill_after_s is not None:
                asyncio.get_running_loop().call_later(kill_after_s, agent.kill)
            return await collector.run_group(ROW, episodes)
        finally:
            await collector.aclose()

    started = time.monotonic()
    try:
        return asyncio.run(go()), time.monotonic() - started
    finally:
        print(f"time to outcome: {time.monotonic() - started:.2f} s")


def _assert_failed(outcome, cause: str) -> None:
    assert outcome.episodes == [], "a failed episode must not reach training"
    assert len(outcome.failures) == 2 and outcome.retries == 2 * RETRIES
    assert all(f"failed after {RETRIES + 1} attempts: " in f for f in outcome.failures)
    assert cause in outcome.failures[0], outcome.failures[0]


def test_agent_killed_mid_episode_fails_the_episodes_at_once(tmp_path):
    with FaultyAgent("slow", tmp_path) as agent:
        outcome, seconds = _run_group(agent.url, kill_after_s=1.0, agent=agent)
    # The retry finds the port closed: the cause is the refused connection.
    _assert_failed(outcome, "ConnectError")
    assert seconds < 1.0 + RUN_TIMEOUT_S


def test_agent_that_hangs_fails_each_attempt_at_its_deadline(tmp_path):
    with FaultyAgent("hang", tmp_path) as agent:
        outcome, seconds = _run_group(agent.url)
    _assert_failed(outcome, "Timeout")
    budget = (RETRIES + 1) * RUN_TIMEOUT_S
    assert budget - 0.5 < seconds < budget + 5


@pytest.mark.parametrize(
    ("mode", "cause"),
    [
        ("malformed-json", "not JSON: JSONDecodeError"),
        ("wrong-shape", "returned list, not an object"),
        ("huge", "more than env.rollout.max_result_bytes=10485760 bytes"),
    ],
)
def test_agent_answering_garbage_fails_the_episode_at_once_with_the_cause(tmp_path, mode, cause):
    """No retry can fix such an answer, so none is spent on it."""
    with FaultyAgent(mode, tmp_path) as agent:
        outcome, seconds = _run_group(agent.url)
    assert outcome.episodes == [] and outcome.retries == 0
    assert len(outcome.failures) == 2
    assert all("failed, not retried (a retry cannot fix it): " in f for f in outcome.failures)
    assert cause in outcome.failures[0], outcome.failures[0]
    assert seconds < RUN_TIMEOUT_S


def test_an_agent_answering_503_is_retried_no_sooner_than_its_retry_after(tmp_path):
    """`busy` answers 503 with `Retry-After: 1`: the back-off (at most 0.05 s here) is raised to
    the second the agent asked for."""
    with FaultyAgent("busy", tmp_path) as agent:
        outcome, seconds = _run_group(agent.url)
    _assert_failed(outcome, "answered 503")
    assert 1.0 * RETRIES <= seconds < 1.0 * RETRIES + RUN_TIMEOUT_S


def test_a_result_that_is_not_a_gym_result_stops_the_run(tmp_path):
    with (
        FaultyAgent("missing-fields", tmp_path) as agent,
        pytest.raises(MalformedGymResultError, match=AGENT) as stopped,
    ):
        _run_group(agent.url)
    print(f"message: {stopped.value}")


def test_a_straggler_episode_ends_at_its_deadline_and_its_group_keeps_the_survivors(tmp_path):
    """One episode of a group of four never answers (every attempt hangs): each attempt ends at
    run_timeout_s, then the episode fails with its cause; the three that answered come back as
    the group (the producer keeps a group with at least two episodes), and the timeouts are
    counted (`rollout/episode_timeouts_total`)."""
    with FaultyAgent("straggle", tmp_path) as agent:
        outcome, seconds = _run_group(agent.url, episodes=4)
    assert [e.full_result["reward"] for e in outcome.episodes] == [1.0, 2.0, 3.0]
    assert outcome.failures == [
        f"agent {AGENT!r} row {ROW['id']!r} failed after {RETRIES + 1} attempts: TimeoutError: "
        f"agent at {agent.url}/run did not finish the episode within "
        f"env.rollout.run_timeout_s={RUN_TIMEOUT_S:g} s"
    ]
    assert (outcome.retries, outcome.timeouts) == (RETRIES, RETRIES + 1)
    budget = (RETRIES + 1) * RUN_TIMEOUT_S
    assert budget - 0.5 < seconds < budget + 5

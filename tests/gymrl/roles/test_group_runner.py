"""`RayGroupRunner` on real Ray: an outcome with failed episodes asks the generation server
whether its engine stopped for good, and the run then stops with the engine's own error, not
with the agents' failures charged to the failure budget."""

from __future__ import annotations

import pytest
import ray

from gymrl.generation.types import EngineFailedError
from gymrl.roles.generation_server import GenerationRole
from gymrl.roles.gym_shard import RayGroupRunner
from nemo_gym_ext.gym_launch import PolicyEndpoint
from nemo_gym_ext.rollout import GroupOutcome

UNUSED_ENDPOINT = PolicyEndpoint("http://unused/v1", "unused-key", "unused-model")


@ray.remote(num_cpus=0)
class ShardStandIn:
    """Answers every group with the failures it was made with (a Gym shard's `run_group`)."""

    def __init__(self, failures: list[str]):
        self._failures = failures

    def run_group(self, row: dict, num_episodes: int) -> GroupOutcome:
        return GroupOutcome(row_id=row["id"], agent="agent", failures=list(self._failures))


@ray.remote(num_cpus=0)
class GenerationServerStandIn:
    """The generation server's `engine_failure`, counting the questions."""

    def __init__(self, failure: str | None):
        self._failure = failure
        self.asked = 0

    def engine_failure(self) -> EngineFailedError | None:
        self.asked += 1
        return None if self._failure is None else EngineFailedError(self._failure)

    def times_asked(self) -> int:
        return self.asked


def outcome_of(runner: RayGroupRunner) -> GroupOutcome:
    group = runner.submit("agent", {"id": "row-0"}, 2)
    assert runner.finished([group], timeout_s=30) == [group]
    return runner.outcome(group)


@pytest.mark.usefixtures("local_ray")
def test_failed_episodes_with_a_failed_engine_stop_with_the_engines_error():
    server = GenerationServerStandIn.remote("the torch engine stopped after a failed step (boom)")
    runner = RayGroupRunner(
        {"agent": ShardStandIn.remote(["HTTPStatusError: 500 from the policy server"])},
        GenerationRole(server, UNUSED_ENDPOINT).raise_if_engine_failed,
    )
    with pytest.raises(EngineFailedError, match="failed step \\(boom\\)"):
        outcome_of(runner)


@pytest.mark.usefixtures("local_ray")
def test_a_serving_engine_leaves_failures_to_the_budget_and_clean_groups_ask_nothing():
    server = GenerationServerStandIn.remote(None)
    check = GenerationRole(server, UNUSED_ENDPOINT).raise_if_engine_failed
    failing = RayGroupRunner({"agent": ShardStandIn.remote(["the agent crashed"])}, check)
    assert outcome_of(failing).failures == ["the agent crashed"]
    clean = RayGroupRunner({"agent": ShardStandIn.remote([])}, check)
    assert outcome_of(clean).failures == []
    assert ray.get(server.times_asked.remote(), timeout=30) == 1

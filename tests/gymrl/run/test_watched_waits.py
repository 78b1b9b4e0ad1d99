"""The trainer loop's long waits under the no-progress watchdog and a stop, on a real local Ray:
the Megatron trainer's calls to its ranks and the recipe's validation pass. Each is named in the
watchdog's report, and a stall, its deadline or a stop ends it within a slice
(gymrl.cluster.ray_calls).

The ranks are stand-in actors that the real `MegatronTrainerGroup` starts and calls: under test
is how the group waits, not Megatron (imported only inside a real rank; test_megatron_real.py).
"""

import os
import re
import signal
import sys
import time

import pytest
import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group

from gymrl.cluster.placement import RolePlacement
from gymrl.config.compose import compose_raw
from gymrl.experience.held_out import Validator
from gymrl.preflight.validate import validate_config
from gymrl.recipes.training import GRPORecipe
from gymrl.roles.generation_server import GenerationRole
from gymrl.roles.gym_shard import RayGroupRunner
from gymrl.run.progress import NoProgressError, ProgressWatch
from gymrl.run.stop import StopRequested, stop_request_behind
from gymrl.trainer.megatron import group as megatron_group
from nemo_gym_ext.gym_launch import PolicyEndpoint

pytestmark = pytest.mark.usefixtures("local_ray")
# The ranks run in workers of a runtime environment of their own (the group's env_vars), whose
# path does not hold the tests' folders: Ray sends this module's stand-ins by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

# Short enough for a test, long enough that rank 0's answer (within a slice) comes before it.
PROGRESS_TIMEOUT_S = 3.0
STALLED_RANK = 1
HANG_S = 600.0


class StandInRank:
    """A trainer rank: every call answers at once, except on rank 1, which hangs (a collective
    that a lost peer never joins); rank 0 cannot load a checkpoint that is not there."""

    def __init__(self, config, *, temperature):
        import torch  # noqa: F401  (loaded, as in a real rank, before a call's tensors arrive)

        self.rank = int(os.environ["RANK"])  # set by the group (distributed_env)

    def ready(self):
        return self.rank

    def train_step(self, trajectories, advantages, parity):
        return self._answer({})

    def save_checkpoint(self, directory, step, data_state):
        return self._answer(f"{directory}/step_{step}")

    def load_checkpoint(self, path):
        if self.rank == 0:
            raise FileNotFoundError(f"no checkpoint at {path}")
        return self._answer({})

    def _answer(self, value):
        if self.rank == STALLED_RANK:
            time.sleep(HANG_S)
        return value


@pytest.fixture
def start_group(monkeypatch):
    """Starts a two-rank group of stand-in ranks with a given call deadline; ends them after."""
    monkeypatch.setattr(megatron_group, "MegatronPolicyTrainer", StandInRank)
    config = validate_config(compose_raw(["+experiment=math_1p5b"]))
    bundles = placement_group([{"CPU": 0.01}] * 2)
    ray.get(bundles.ready(), timeout=60)
    started = []

    def start(call_timeout_s):
        group = megatron_group.MegatronTrainerGroup(
            config,
            placement_group=bundles,
            ranks=RolePlacement(gpus_per_actor=0.0, cpus_per_actor=0.0, bundle_of_actor=(0, 1)),
            temperature=1.0,
            start_timeout_s=120,
            call_timeout_s=call_timeout_s,
        )
        started.append(group)
        return group

    yield start
    for group in started:
        group.shutdown()
    remove_placement_group(bundles)


def test_a_stalled_rank_is_stopped_by_the_watchdog_naming_the_call_and_the_rank(start_group):
    """A step whose deadline (grpo.batch_timeout_s) is far off ends at run.progress_timeout_s
    with the report naming the call and the rank that did not answer, not "busy"."""
    group = start_group(call_timeout_s=30)
    watch = ProgressWatch(PROGRESS_TIMEOUT_S)  # as the recipe makes it (1 s polls)
    watch.start()
    started = time.monotonic()
    try:
        with pytest.raises(NoProgressError) as raised:
            group.train_step([], torch.zeros(0))
        stopped_s = time.monotonic() - started
    finally:
        watch.stop()
    # docs/reliability.md: the time from a stalled Megatron call to the watchdog's named stop.
    print(f"stalled rank -> NoProgressError after {stopped_s:.2f} s ({PROGRESS_TIMEOUT_S:g} s)")
    assert (
        "trainer loop: waiting for the Megatron trainer's train_step (grpo.batch_timeout_s) "
        "from rank 1 (of 2) for "
    ) in str(raised.value)
    assert "(its deadline 30 s)" in str(raised.value)
    assert PROGRESS_TIMEOUT_S <= stopped_s < PROGRESS_TIMEOUT_S + 3.0  # a poll, a slice


def test_a_missed_deadline_names_the_call_the_silent_rank_and_the_key(start_group, tmp_path):
    group = start_group(call_timeout_s=2)
    expected = (
        "the Megatron trainer's save_checkpoint (grpo.batch_timeout_s) did not finish within "
        "2 s: no answer from rank 1 (of 2)"
    )
    with pytest.raises(TimeoutError, match=f"^{re.escape(expected)}$"):
        group.save_checkpoint(tmp_path, 3, {"position": 0})


def test_a_failing_rank_s_own_error_arrives_without_waiting_for_the_stalled_one(start_group):
    group = start_group(call_timeout_s=30)
    started = time.monotonic()
    with pytest.raises(FileNotFoundError, match="no checkpoint at /nowhere"):
        group.load_checkpoint("/nowhere")
    assert time.monotonic() - started < 10


def test_a_stop_signal_leaves_a_stalled_call_within_a_slice(start_group):
    """Slurm's SIGTERM (here the stop deadline's SIGALRM, whose handler raises) comes out of the
    call within a slice, not at its deadline."""
    group = start_group(call_timeout_s=30)

    def on_alarm(signum, _frame):
        raise StopRequested(signum, step_finished=False, reason="deadline")

    saved = signal.signal(signal.SIGALRM, on_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.0)
        started = time.monotonic()
        with pytest.raises(BaseException) as raised:
            group.train_step([], torch.zeros(0))
        waited = time.monotonic() - started
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, saved)
    assert stop_request_behind(raised.value) is not None, raised.value
    assert waited < 5, f"the stop waited {waited:.1f} s"


@ray.remote(num_cpus=0)
class StalledShard:
    """A Gym shard whose episodes never come back."""

    def run_group(self, row, num_episodes):
        time.sleep(HANG_S)


@ray.remote(num_cpus=0)
class ValidationWindow:
    """The policy server's validation window, all the pass asks of the generation server."""

    def set_validating(self, validating):
        return validating


def test_a_stalled_validation_pass_is_named_in_the_watchdog_report(tmp_path):
    recipe = GRPORecipe(validate_config(compose_raw(["+experiment=smoke"])), tmp_path)
    shard = StalledShard.remote()
    recipe.generation = GenerationRole(
        ValidationWindow.remote(), PolicyEndpoint("http://unused/v1", "key", "policy")
    )
    row = {"id": "calc-0", "agent_ref": {"name": "calc"}}
    recipe.validator = Validator(
        [row], RayGroupRunner({"calc": shard}), timeout_s=60, max_refused_share=0.1
    )
    watch = ProgressWatch(PROGRESS_TIMEOUT_S)
    watch.start()
    try:
        with pytest.raises(NoProgressError) as raised:
            recipe._validate()
    finally:
        watch.stop()
        ray.kill(shard)
    report = str(raised.value)
    assert "trainer loop: waiting for a validation pass (grpo.batch_timeout_s) for " in report

"""The recipe's lifecycle on a real local Ray with the smoke config: each setup stage fails in
turn, and `cleanup()` must leave no actor, server or process behind.

Checks, for every stage: the stage's own error reaches the caller; every actor the recipe
created is dead before Ray shuts down (asked through its handle, as the state API needs Ray's
dashboard); the policy server's loopback port no longer accepts connections; and no process
started during the test (Ray's own, actors, their children, orphaned or not) is still alive,
found by an environment marker every one of them inherits. Each case starts Ray and the tiny
model (a minute on two busy cores), so all but one are `slow`.
"""

import os
import re
import socket
import time
import uuid

import psutil
import pytest
import ray

import gymrl.cluster.session
import gymrl.recipes.training
import gymrl.roles.generation_server
import gymrl.roles.gym_shard
import gymrl.roles.replay_buffer_actor
import gymrl.roles.trainer
from gymrl.config.compose import compose_raw
from gymrl.preflight.validate import validate_config
from gymrl.recipes.training import GRPORecipe

MARKER = "GYMRL_LIFECYCLE_TEST"


class InjectedFailure(RuntimeError):
    pass


def _raise(*args, **kwargs):
    raise InjectedFailure("injected")


class RecordedActors:
    """Wraps an actor class so every handle it creates is kept for the leak check."""

    def __init__(self, actor_class, handles):
        self._actor_class = actor_class
        self._handles = handles

    def options(self, **options):
        return RecordedActors(self._actor_class.options(**options), self._handles)

    def remote(self, *args, **kwargs):
        handle = self._actor_class.remote(*args, **kwargs)
        self._handles.append(handle)
        return handle


def _alive(handle, grace_s: float = 10.0) -> bool:
    """Whether the actor still answers after `grace_s`: `ray.kill` returns before the actor's
    process is gone, so a call right after it may still be served."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            ray.get(handle.__ray_ready__.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.5)


def _marked_processes(marker: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if process.pid != os.getpid() and process.environ().get(MARKER) == marker:
                found.append(process)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def _port_open(url: str) -> bool:
    host, port = re.match(r"http://([^:/]+):(\d+)", url).groups()
    with socket.socket() as probe:
        probe.settimeout(2)
        return probe.connect_ex((host, int(port))) == 0


# stage -> (how to make it fail: a builder that raises, or a real start-up that cannot finish;
#           the error the caller must see)
STAGES = {
    "ray": (lambda mp: mp.setattr(gymrl.cluster.session, "start_ray", _raise), InjectedFailure),
    # Killed while its constructor still loads the model.
    "generation server": (
        lambda mp: mp.setattr(
            gymrl.roles.generation_server, "start_timeout_s", lambda config: 0.01
        ),
        TimeoutError,
    ),
    "trainer": (
        lambda mp: mp.setattr(gymrl.recipes.training, "start_trainer", _raise),
        InjectedFailure,
    ),
    # The shard actor starts and its constructor fails (there is no tokenizer there).
    "gym shards": (
        lambda mp: mp.setattr(
            gymrl.recipes.training, "model_folder", lambda policy: "/nonexistent"
        ),
        ray.exceptions.ActorDiedError,
    ),
    "replay buffer": (
        lambda mp: mp.setattr(gymrl.roles.replay_buffer_actor, "RemoteReplayBuffer", _raise),
        InjectedFailure,
    ),
    "first refit": (lambda mp: mp.setattr(GRPORecipe, "_refit", _raise), InjectedFailure),
    "rows": (lambda mp: mp.setattr(gymrl.recipes.training, "load_rows", _raise), InjectedFailure),
    "logger": (
        lambda mp: mp.setattr(gymrl.recipes.training, "build_logger", _raise),
        InjectedFailure,
    ),
    "producer": (
        lambda mp: mp.setattr(gymrl.recipes.training, "RolloutProducer", _raise),
        InjectedFailure,
    ),
    "first step": (lambda mp: mp.setattr(GRPORecipe, "_step", _raise), InjectedFailure),
}
FAST = {"gym shards"}  # half-way through: generation and trainer up, a shard failing


@pytest.mark.parametrize(
    "stage", [s if s in FAST else pytest.param(s, marks=pytest.mark.slow) for s in STAGES]
)
def test_a_failing_setup_stage_leaves_nothing_running(stage, tmp_path, monkeypatch, capsys):
    marker = uuid.uuid4().hex
    monkeypatch.setenv(MARKER, marker)
    handles = []
    for module, name in [
        (gymrl.roles.generation_server, "GenerationServer"),
        (gymrl.roles.gym_shard, "GymShard"),
        (gymrl.roles.replay_buffer_actor, "ReplayBufferActor"),
        (gymrl.roles.trainer, "PolicyTrainerActor"),
    ]:
        monkeypatch.setattr(module, name, RecordedActors(getattr(module, name), handles))
    alive_at_shutdown = []
    real_shutdown = ray.shutdown

    def checked_shutdown():
        alive_at_shutdown.extend(handle for handle in handles if _alive(handle))
        real_shutdown()

    monkeypatch.setattr(ray, "shutdown", checked_shutdown)
    inject_failure, expected_error = STAGES[stage]
    inject_failure(monkeypatch)
    config = validate_config(
        compose_raw(
            [
                "+experiment=smoke",
                f"run.output_dir={tmp_path}",
                "logger.progress_bar=false",
                "logger.wandb.mode=disabled",
            ]
        )
    )

    recipe = GRPORecipe(config, tmp_path)
    with pytest.raises(expected_error):
        try:
            recipe.setup()
            recipe.train()
        finally:
            recipe.cleanup()

    assert not ray.is_initialized()
    assert alive_at_shutdown == [], f"actors still alive when Ray shut down: {alive_at_shutdown}"
    urls = re.findall(r"policy server .*: (http://\S+)", capsys.readouterr().out)
    assert not [url for url in urls if _port_open(url)], "the policy server still listens"
    deadline = time.monotonic() + 30
    while (left := _marked_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == [], f"processes left: {[(p.pid, p.name()) for p in left]}"
    if stage == "first step":
        assert not recipe.producer.is_alive()

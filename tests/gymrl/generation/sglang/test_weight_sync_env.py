"""One NCCL environment for the weight-sync communicator (issue 19 item 6).

The trainer's rank 0 and every SGLang server's ranks join one communicator, so NCCL must run with
the same settings on both sides (SGLang forces `WEIGHT_SYNC_NCCL_ENV` in its own processes). Each
place that starts one of them is asked what it actually sets, without a GPU or a cluster: the
SGLang server's launch (a real child process through `SGLangServerProcess`, which reports its
environment), the torch trainer's actor and every Megatron rank (the `runtime_env` they hand Ray,
caught at the Ray boundary). A parent environment that says otherwise must not win.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import pytest
import ray

import gymrl.roles.trainer as trainer_role
import gymrl.trainer.megatron.group as megatron_group
from gymrl.cluster.placement import plan_placement
from gymrl.config.compose import compose_raw
from gymrl.generation.sglang.servers import SGLangServerProcess
from gymrl.generation.sglang.weight_sync import WEIGHT_SYNC_NCCL_ENV
from gymrl.preflight.validate import validate_config

# What SGLang 0.5.23 sets in its processes unless the environment has them
# (`_set_envs_and_config` in sglang/srt/entrypoints/engine.py).
SGLANG_FORCED = {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}
PRINT_NCCL_ENV = (
    "import json, os; "
    "print(json.dumps({k: v for k, v in os.environ.items() if k.startswith('NCCL_')}))"
)


def _nccl(env: dict[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items() if key.startswith("NCCL_")}


@pytest.fixture
def parent_env(monkeypatch) -> dict[str, str]:
    """The launching process's own NCCL settings: one the weight sync overrides, one it keeps."""
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "1")
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    return _nccl(dict(os.environ))


def _server_nccl_env(tmp_path) -> dict[str, str]:
    """The NCCL variables of a process launched the way an SGLang server is launched."""
    log = tmp_path / "server.log"
    server = SGLangServerProcess(
        [sys.executable, "-c", PRINT_NCCL_ENV], base_url="http://127.0.0.1:1", log_path=log
    )
    server.start()
    deadline = time.monotonic() + 60
    while server.exit_code() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.exit_code() == 0, server.log_tail()
    return json.loads(log.read_text().strip().splitlines()[-1])


def _server_sets(tmp_path, parent: dict[str, str]) -> dict[str, str]:
    """What the server's launch sets on top of the environment it inherits."""
    return {
        key: value for key, value in _server_nccl_env(tmp_path).items() if parent.get(key) != value
    }


class _RecordingActorClass:
    """Stands for a Ray actor class: records each `.options(...)`, starts nothing."""

    def __init__(self) -> None:
        self.options_seen: list[dict[str, Any]] = []

    def options(self, **options: Any) -> _RecordingActorClass:
        self.options_seen.append(options)
        return self

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return _Handle(len(self.options_seen) - 1)


class _Handle:
    def __init__(self, rank: int) -> None:
        self.ready = self.weight_version = _Method(rank)


class _Method:
    def __init__(self, answer: Any) -> None:
        self._answer = answer

    def remote(self) -> Any:
        return self._answer


def _env_vars(options: dict[str, Any]) -> dict[str, str]:
    return options.get("runtime_env", {}).get("env_vars", {})


def test_sglang_servers_run_with_the_weight_sync_nccl_env(tmp_path, parent_env):
    env = _server_nccl_env(tmp_path)
    assert env == parent_env | dict(WEIGHT_SYNC_NCCL_ENV)  # NCCL_DEBUG passes, CUMEM is set
    assert SGLANG_FORCED.items() <= env.items()  # what SGLang would force anyway


def test_the_torch_trainer_sets_what_the_servers_set(tmp_path, monkeypatch, parent_env):
    """Ray starts the actor with the raylet's environment plus its `env_vars` (which win), as
    the server gets its parent's plus its launch's settings."""
    actor_class = _RecordingActorClass()
    monkeypatch.setattr(trainer_role, "PolicyTrainerActor", actor_class)
    monkeypatch.setattr(trainer_role, "wait_for", lambda ref, **_: ref)
    config = validate_config(compose_raw(["+experiment=smoke"]))
    trainer_role.TorchTrainerRole(
        config, torch_threads=1, placement=plan_placement(config), group=None
    )
    [options] = actor_class.options_seen
    assert (
        _nccl(_env_vars(options))
        == _server_sets(tmp_path, parent_env)
        == dict(WEIGHT_SYNC_NCCL_ENV)
    )


def test_every_megatron_rank_sets_what_the_servers_set(tmp_path, monkeypatch, parent_env):
    """Rank 0 joins the servers' communicator; every rank shares its settings, since all the
    trainer's ranks are in one communicator of their own too."""
    config = validate_config(compose_raw(["+experiment=math_1p5b"]))
    ranks = plan_placement(config).trainer
    world_size = len(ranks.bundle_of_actor)
    trainer_ranks, address_probe = _RecordingActorClass(), _RecordingActorClass()
    monkeypatch.setattr(
        ray, "remote", lambda what: trainer_ranks if isinstance(what, type) else address_probe
    )
    answers = iter([("10.0.0.1", 29500), list(range(world_size))])
    monkeypatch.setattr(megatron_group, "wait_for", lambda refs, **_: next(answers))
    megatron_group.MegatronTrainerGroup(
        config,
        placement_group=None,
        ranks=ranks,
        temperature=1.0,
        start_timeout_s=1.0,
        call_timeout_s=1.0,
    )
    assert world_size > 1 and len(trainer_ranks.options_seen) == world_size
    server_sets = _server_sets(tmp_path, parent_env)
    for rank, options in enumerate(trainer_ranks.options_seen):
        env = _env_vars(options)
        assert env["RANK"] == str(rank)
        assert _nccl(env) == server_sets == dict(WEIGHT_SYNC_NCCL_ENV), rank

"""The Gym launcher: what Gym receives, the readiness deadline, and that stopping ends every
process it started (by process group), on success and on failure. A stand-in `ng_run`
(fake_ng_run.py) plays Gym with real processes and a real head server on loopback."""

import copy
import os
import socket
import sys
import time
from pathlib import Path

import pytest
import yaml

from nemo_gym_ext import gym_launch
from nemo_gym_ext.config import (
    COMPACTION_ADAPTER,
    INJECTED_GYM_KEYS,
    RECIPE_ONLY_KEYS,
    build_gym_actor_config,
)
from nemo_gym_ext.gym_launch import (
    GymDeployment,
    GymStartError,
    GymVenvMissingError,
    PolicyEndpoint,
    agent_urls,
    deployment_config,
    link_server_venvs,
    shard_port_range,
    start_deployment,
)
from nemo_gym_ext.ports import free_port_in_range

POLICY = PolicyEndpoint("http://10.0.0.1:8000/v1", "run-key", "SmolLM2-135M-Instruct")


@pytest.fixture
def venv(tmp_path):
    """A directory shaped like Gym's venv whose `ng_run` is the stand-in."""
    launcher = tmp_path / "venv" / "bin" / "ng_run"
    launcher.parent.mkdir(parents=True)
    source = (Path(__file__).parent / "fake_ng_run.py").read_text()
    launcher.write_text(f"#!{sys.executable}\n{source}")
    launcher.chmod(0o755)
    return launcher.parent.parent


def _config(tmp_path, **fake):
    config = deployment_config(
        {"config_paths": ["x.yaml"], "fake_gym": fake},
        policy=POLICY,
        host="127.0.0.1",
        head_port=free_port_in_range("127.0.0.1", 21000, 22000),
        port_range=(21000, 22000),
        server_venvs=tmp_path / "server-venvs",
        policy_adapter="vllm_model",
    )
    return config


def _alive(pid):
    """Running and not a zombie waiting for a parent that is gone."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _pids(deployment):
    return [int(pid) for pid in (deployment.work_dir / "pids").read_text().split()]


def test_gym_receives_its_config_plus_exactly_the_injected_keys(tmp_path):
    nemo_gym = {
        "truncate_noncontiguous_episodes": True,
        "on_malformed_result": "mask",
        "config_paths": ["resources_servers/a/configs/a.yaml"],
        "my_agent": {"responses_api_agents": {"simple_agent": {"entrypoint": "app.py"}}},
        "token_id_capture": {"dir": "/tmp/c"},
    }
    before = copy.deepcopy(nemo_gym)
    actor = build_gym_actor_config(
        nemo_gym, source="gym_launch", router_replay_enabled=False, token_capture_enabled=False
    )
    gym_config = copy.deepcopy(actor.gym_config)
    config = deployment_config(
        actor.gym_config,
        policy=POLICY,
        host="10.0.0.2",
        head_port=20001,
        port_range=(20001, 25000),
        server_venvs=Path("/venv/server-venvs"),
        policy_adapter="vllm_model",
    )
    assert nemo_gym == before and actor.gym_config == gym_config, "inputs are not mutated"
    assert not RECIPE_ONLY_KEYS & set(config)
    injected = {key: config[key] for key in set(config) - set(gym_config)}
    assert set(injected) <= INJECTED_GYM_KEYS
    assert injected == {
        "policy_base_url": "http://10.0.0.1:8000/v1",
        "policy_api_key": "run-key",
        "policy_model_name": "SmolLM2-135M-Instruct",
        "head_server": {"host": "10.0.0.2", "port": 20001},
        "default_host": "10.0.0.2",
        "port_range_low": 20001,
        "port_range_high": 25000,
        "skip_venv_if_present": True,
        "uv_venv_dir": "/venv/server-venvs",
        "policy_model": {
            "responses_api_models": {
                "vllm_model": {
                    "entrypoint": "app.py",
                    "base_url": "${policy_base_url}",
                    "api_key": "${policy_api_key}",
                    "model": "${policy_model_name}",
                    "return_token_id_information": True,
                    "uses_reasoning_parser": False,
                }
            }
        },
    }
    assert {key: config[key] for key in gym_config} == gym_config


def test_the_compaction_adapter_is_injected_as_the_policy_model_in_training_mode():
    config = deployment_config(
        {"config_paths": ["x.yaml"]},
        policy=POLICY,
        host="127.0.0.1",
        head_port=20001,
        port_range=(20001, 25000),
        server_venvs=Path("/venv/server-venvs"),
        policy_adapter=COMPACTION_ADAPTER,
    )
    assert config["policy_model"] == {
        "responses_api_models": {
            "vllm_model_with_compaction": {
                "entrypoint": "app.py",
                "base_url": "${policy_base_url}",
                "api_key": "${policy_api_key}",
                "model": "${policy_model_name}",
                "return_token_id_information": True,
                "uses_reasoning_parser": False,
            }
        }
    }


def test_every_shipped_server_and_every_server_of_the_roots_gets_gyms_own_venv(tmp_path):
    venv = tmp_path / "venv"
    site = venv / "lib" / "python3.11" / "site-packages"
    ours = tmp_path / "gym_servers"
    for folder, server, marker in [
        (site, "resources_servers/example_multi_step", "requirements.txt"),
        (site, "responses_api_models/vllm_model", "pyproject.toml"),
        (site, "responses_api_agents/not_a_server", "README.md"),
        (ours, "responses_api_agents/my_compaction_agent", "requirements.txt"),
        (ours, "not_a_kind/my_server", "requirements.txt"),
    ]:
        (folder / server).mkdir(parents=True)
        (folder / server / marker).write_text("")
    root = link_server_venvs(venv, [ours])
    assert link_server_venvs(venv, [ours]) == root  # a second shard finds the links made
    linked = sorted(str(p.relative_to(root)) for p in root.glob("*/*/.venv"))
    assert linked == [
        "resources_servers/example_multi_step/.venv",
        "responses_api_agents/my_compaction_agent/.venv",
        "responses_api_models/vllm_model/.venv",
    ]
    assert all((root / link).resolve() == venv.resolve() for link in linked)


@pytest.mark.parametrize("roots", [[], ["gym_servers", "more_servers"]])
def test_gym_searches_the_server_roots_first(venv, tmp_path, roots):
    """ng_run and the servers it starts find servers under NEMO_GYM_EXTRA_ROOTS before their
    working directory and the wheel; without roots the variable is not set at all (an empty
    one would still be read, as the working directory)."""
    server_roots = [tmp_path / root for root in roots]
    for root in server_roots:
        root.mkdir()
    deployment = start_deployment(
        {"config_paths": ["x.yaml"]},
        policy=POLICY,
        venv=venv,
        work_dir=tmp_path / "w",
        host="127.0.0.1",
        port_range=(21000, 22000),
        timeout_s=60,
        policy_adapter="vllm_model",
        server_roots=server_roots,
    )
    try:
        seen = (deployment.work_dir / "extra_roots").read_text()
    finally:
        deployment.stop()
    assert seen == (os.pathsep.join(str(root) for root in server_roots) or "unset")


def test_shards_get_disjoint_port_ranges():
    ranges = [shard_port_range(i, 3, (20000, 29000)) for i in range(3)]
    assert ranges == [(20000, 23000), (23000, 26000), (26000, 29000)]


def test_a_shard_range_with_no_free_port_is_a_start_error(tmp_path):
    """Reported like any shard that cannot start (the recipe prints it without a traceback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        with pytest.raises(GymStartError, match=r"no free port .* for the Gym head server"):
            start_deployment(
                {},
                policy=POLICY,
                venv=tmp_path / "venv",
                work_dir=tmp_path / "w",
                host="127.0.0.1",
                port_range=(port, port + 1),
                timeout_s=1,
                policy_adapter="vllm_model",
                server_roots=[],
            )


def test_a_missing_venv_names_the_make_target(tmp_path):
    with pytest.raises(GymVenvMissingError, match="make gym-venv"):
        GymDeployment(_config(tmp_path), venv=tmp_path / "nowhere", work_dir=tmp_path / "w")


def test_ready_deployment_lists_its_agents_and_stops_every_process(venv, tmp_path):
    deployment = GymDeployment(_config(tmp_path), venv=venv, work_dir=tmp_path / "w")
    deployment.start(timeout_s=60)
    try:
        assert yaml.safe_load(deployment.config_path.read_text())["policy_api_key"] == "run-key"
        assert agent_urls(deployment.head_url, timeout_s=5) == {"my_agent": "http://h:1"}
        pids = _pids(deployment)
        assert all(_alive(pid) for pid in pids)
    finally:
        deployment.stop()
    assert not any(_alive(pid) for pid in pids)


def test_not_ready_within_the_deadline_stops_everything_and_says_so(venv, tmp_path):
    deployment = GymDeployment(
        _config(tmp_path, mode="never_ready"), venv=venv, work_dir=tmp_path / "w"
    )
    started = time.monotonic()
    with pytest.raises(GymStartError, match=r"env\.gym\.start_timeout_s=3 s"):
        deployment.start(timeout_s=3)
    assert time.monotonic() - started < 30
    assert not any(_alive(pid) for pid in _pids(deployment))


def test_a_deployment_that_exits_reports_its_code_and_log(venv, tmp_path):
    deployment = GymDeployment(_config(tmp_path, mode="exit"), venv=venv, work_dir=tmp_path / "w")
    with pytest.raises(GymStartError, match="exited with code 3") as raised:
        deployment.start(timeout_s=60)
    assert "fake gym: refusing this config" in str(raised.value)


def test_a_server_that_fails_at_import_is_reported_by_its_first_error(venv, tmp_path):
    """The cause sits above the shutdown noise that ends the log: the error shows the traceback
    that names it, not the log's last lines."""
    deployment = GymDeployment(_config(tmp_path, mode="crash"), venv=venv, work_dir=tmp_path / "w")
    with pytest.raises(GymStartError, match="exited with code 1") as raised:
        deployment.start(timeout_s=60)
    message = str(raised.value)
    assert "the first error in its log" in message
    assert message.endswith(
        "(grl_sokoban) Traceback (most recent call last):\n"
        '(grl_sokoban)   File "app.py", line 3, in <module>\n'
        "(grl_sokoban)     import gymnasium\n"
        "(grl_sokoban) ModuleNotFoundError: No module named 'gymnasium'"
    )
    assert "shutting down" not in message


def test_a_restart_in_the_same_folder_is_reported_by_its_own_log_not_the_last_attempts(
    venv, tmp_path
):
    """A resumed run appends to the Gym log of the attempt before it: that attempt's import
    error, fixed since, must not be named as this start's cause."""
    work_dir = tmp_path / "w"
    first = GymDeployment(_config(tmp_path, mode="crash"), venv=venv, work_dir=work_dir)
    with pytest.raises(GymStartError, match="gymnasium"):
        first.start(timeout_s=60)
    again = GymDeployment(_config(tmp_path, mode="exit"), venv=venv, work_dir=work_dir)
    with pytest.raises(GymStartError, match="exited with code 3") as raised:
        again.start(timeout_s=60)
    message = str(raised.value)
    assert "gymnasium" not in message and "shutting down" not in message
    assert message.endswith("which ends with:\nfake gym: refusing this config\n")
    assert "ModuleNotFoundError" in (work_dir / "gym.log").read_text()  # still there to read


def test_a_server_ignoring_sigterm_is_killed_with_its_group(venv, tmp_path, monkeypatch):
    monkeypatch.setattr(gym_launch, "_STOP_GRACE_S", 1.0)
    deployment = GymDeployment(
        _config(tmp_path, stubborn_child=True), venv=venv, work_dir=tmp_path / "w"
    )
    deployment.start(timeout_s=60)
    launcher, child = _pids(deployment)
    deployment.stop()
    assert not _alive(launcher) and not _alive(child)
    assert os.getpgid(os.getpid()) != launcher, "the group stopped is Gym's, not ours"


def test_gym_starts_a_ray_instance_of_its_own_whatever_cluster_runs_here(
    venv, tmp_path, monkeypatch
):
    """Gym's launcher calls `ray.init()` with no address, which joins the latest cluster a
    `ray start` left on the machine (/tmp/ray/ray_current_cluster) or the one RAY_ADDRESS names:
    under launch/ray.sub, the recipe's own cluster, of another Ray version and with its own
    token. Gym gets RAY_ADDRESS=local, which always starts a new instance."""
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    deployment = start_deployment(
        {"config_paths": ["x.yaml"]},
        policy=POLICY,
        venv=venv,
        work_dir=tmp_path / "w",
        host="127.0.0.1",
        port_range=(22000, 23000),
        timeout_s=60,
        policy_adapter="vllm_model",
        server_roots=[],
    )
    try:
        seen = (deployment.work_dir / "ray_address").read_text()
    finally:
        deployment.stop()
    assert seen == "local"

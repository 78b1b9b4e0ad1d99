"""Run a NeMo-Gym deployment for one shard, or find the agents of one someone else runs.

NeMo-Gym runs from its own virtual environment (`make gym-venv`, `env.gym.venv`): its wheel pins
dependencies the recipe's own environment does not share, so this module never imports
`nemo_gym`. It writes the deployment's config to a YAML file, runs Gym's own launcher (`ng_run`,
which starts the head server and every server of the config as its children) in a new session,
and talks to the head server over HTTP: `/readyz` for readiness, `/server_instances` for the
agents' URLs. It runs under the same supervisor as the SGLang servers
(`nemo_gym_ext.processes.ChildProcess`): stopping signals the whole process group (the launcher,
its servers and the Ray instance it starts), never processes by name, so nothing outlives the
shard, also when start-up fails or the shard's actor is killed.

What Gym receives is the shard's `env.nemo_gym` (recipe-only keys already taken out) plus what
only the recipe knows (:func:`deployment_config`): the policy server's URL, key and model name,
the head server's address and the shard's port range, a `policy_model` server (Gym's `vllm_model`
adapter in training mode, returning token ids, or its `vllm_model_with_compaction` twin, which
also forwards a compaction agent's `required_prefix_token_ids`; `env.gym.policy_adapter`) and
where each server's virtual environment is (Gym's own, linked per server by
:func:`link_server_venvs`, so no server installs anything).

Servers of this project's own (`gym_servers/`, `env.gym.server_roots`) are found the way `ng_run`
finds any server: a server block `<name>: {<kind>: {<server>: {entrypoint: app.py}}}` runs
`<root>/<kind>/<server>/app.py` from the first search root holding that folder with a
`requirements.txt` or `pyproject.toml`, the roots being `NEMO_GYM_EXTRA_ROOTS` (set here to the
server roots), then `ng_run`'s working directory, then Gym's site-packages; its venv is
`<uv_venv_dir>/<kind>/<server>/.venv`, which :func:`link_server_venvs` links for them as for the
wheel's. Gym's own packages (`responses_api_agents`, ...) are namespace packages, so a server
there imports the wheel's (`responses_api_agents.simple_agent_with_compaction`) as its own.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from nemo_gym_ext.config import AGENT_KIND, SERVER_KINDS, PolicyAdapter
from nemo_gym_ext.ports import NoFreePortError, free_port_in_range
from nemo_gym_ext.processes import ChildProcess

GYM_VENV_TARGET = "make gym-venv"
# Where every server Gym ships is linked to Gym's own environment (Gym's `uv_venv_dir` layout:
# <dir>/<server kind>/<server>/.venv).
SERVER_VENVS_DIR = "server-venvs"
POLICY_MODEL_SERVER = "policy_model"
# Where ng_run (and every server it starts) looks for servers before its working directory and
# the wheel (nemo_gym.component_search_roots), os.pathsep-separated.
EXTRA_ROOTS_ENV = "NEMO_GYM_EXTRA_ROOTS"
_POLL_S = 1.0
_STOP_GRACE_S = 8.0  # the four waits of a stop fit the recipe's deadline for closing a shard


class GymVenvMissingError(FileNotFoundError):
    """NeMo-Gym's virtual environment (or its launcher) is not where the config says."""


class GymStartError(RuntimeError):
    """A Gym deployment that exited or did not become ready within its deadline."""


@dataclass(frozen=True)
class PolicyEndpoint:
    """What a Gym deployment needs to call the policy server."""

    base_url: str  # the OpenAI base URL, `.../v1`
    api_key: str = field(repr=False)  # a secret: never in a repr, a log or an error message
    model_name: str


def gym_launcher(venv: Path) -> Path:
    """Gym's launcher in `venv`, or an error naming the make target that creates it."""
    launcher = venv / "bin" / "ng_run"
    if not launcher.is_file():
        raise GymVenvMissingError(
            f"NeMo-Gym's virtual environment is missing: {launcher} does not exist "
            f"(env.gym.venv = {str(venv)!r}). Create it with `{GYM_VENV_TARGET}` (about 3 minutes, "
            "1.5 GB), or point env.gym.venv at one."
        )
    return launcher


def link_server_venvs(venv: Path, server_roots: Sequence[Path] = ()) -> Path:
    """Give every server Gym ships (`<site-packages>/<kind>/<server>/`) and every server under
    `server_roots` (`<root>/<kind>/<server>/`) Gym's own environment as its venv, in Gym's
    `uv_venv_dir` layout, and return that directory. With `skip_venv_if_present`, Gym then
    starts each server with this interpreter instead of creating and installing a venv per
    server (a network install of about 1.5 GB each). Gym keys a venv by `<kind>/<server>` only,
    so a server of the roots shares the link of a wheel's server of its name (the same
    interpreter either way). Idempotent, so shards starting at once may all call it."""
    root = venv / SERVER_VENVS_DIR
    sources = [*sorted(venv.glob("lib/python*/site-packages")), *server_roots]
    for source in sources:
        for kind in sorted(SERVER_KINDS):
            for server in sorted(source.glob(f"{kind}/*/")):
                if not (
                    (server / "requirements.txt").exists() or (server / "pyproject.toml").exists()
                ):
                    continue
                link = root / kind / server.name / ".venv"
                link.parent.mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(FileExistsError):
                    link.symlink_to(venv.resolve(), target_is_directory=True)
    return root


def deployment_config(
    gym_config: Mapping[str, Any],
    *,
    policy: PolicyEndpoint,
    host: str,
    head_port: int,
    port_range: tuple[int, int],
    server_venvs: Path,
    policy_adapter: PolicyAdapter,
) -> dict[str, Any]:
    """The config Gym receives: the shard's own keys plus what only the recipe knows, the
    `policy_model` server being Gym's `policy_adapter` in training mode.

    `gym_config` is not mutated. The validator refuses every key set here when a user writes it
    (`nemo_gym_ext.config.INJECTED_GYM_KEYS`), so nothing the user wrote is overwritten."""
    config = copy.deepcopy(dict(gym_config))
    config.update(
        policy_base_url=policy.base_url,
        policy_api_key=policy.api_key,
        policy_model_name=policy.model_name,
        head_server={"host": host, "port": head_port},
        default_host=host,
        port_range_low=port_range[0],
        port_range_high=port_range[1],
        skip_venv_if_present=True,
        uv_venv_dir=str(server_venvs),
    )
    config[POLICY_MODEL_SERVER] = {
        "responses_api_models": {
            policy_adapter: {
                "entrypoint": "app.py",
                "base_url": "${policy_base_url}",
                "api_key": "${policy_api_key}",
                "model": "${policy_model_name}",
                # Training mode: every output item carries the token ids the policy produced.
                "return_token_id_information": True,
                "uses_reasoning_parser": False,
            }
        }
    }
    return config


def shard_port_range(index: int, shards: int, port_range: tuple[int, int]) -> tuple[int, int]:
    """Shard `index`'s slice of `port_range`, so that shards on one node never share ports."""
    low, high = port_range
    width = (high - low) // shards
    return low + index * width, low + (index + 1) * width


class GymDeployment:
    """One shard's Gym deployment: `ng_run` and everything it starts, in one process group."""

    def __init__(
        self,
        config: Mapping[str, Any],
        *,
        venv: Path,
        work_dir: Path,
        server_roots: Sequence[Path] = (),
    ):
        """Write the config; start nothing yet (`start`). `server_roots` are searched for
        servers before Gym's working directory and wheel (module docstring)."""
        self._launcher = gym_launcher(venv)
        self.work_dir = work_dir
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.config_path = work_dir / "gym_config.yaml"
        # Owner-only from creation: the config carries the policy server's key.
        descriptor = os.open(self.config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as stream:
            stream.write(yaml.safe_dump(dict(config), sort_keys=False))
        self.log_path = work_dir / "gym.log"
        head = config["head_server"]
        self.head_url = f"http://{head['host']}:{head['port']}"
        self._process = ChildProcess(
            [str(self._launcher), f"+config_paths=[{self.config_path}]"],
            log_path=self.log_path,
            env=_gym_environment(server_roots),
            cwd=self.work_dir,
            stop_grace_s=_STOP_GRACE_S,
        )

    def start(self, timeout_s: float) -> None:
        """Start Gym and wait until its head server says every server is ready; on failure
        everything started is stopped before the error leaves."""
        self._process.start()
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=5.0) as client:
            while True:
                code = self._process.exit_code()
                if code is not None:
                    raise GymStartError(
                        f"the Gym deployment exited with code {code} before it was ready; "
                        f"{self.log_excerpt()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.head_url}/readyz").status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise GymStartError(
                        f"the Gym deployment was not ready within env.gym.start_timeout_s="
                        f"{timeout_s:g} s (head server {self.head_url}); raise the deadline or "
                        f"see {self.log_excerpt()}"
                    )
                time.sleep(_POLL_S)

    def log_excerpt(self) -> str:
        """What of the log explains a failed start: its first error (a server that failed at
        import; the launcher's shutdown noise ends the log), else its tail."""
        first = self._process.log_first_error()
        if first is not None:
            return f"the first error in its log ({self.log_path}):\n{first}"
        return f"its log ({self.log_path}), which ends with:\n{self._process.log_tail()}"

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def stop(self) -> None:
        """Stop the launcher's whole process group (`ChildProcess.stop`)."""
        self._process.stop(_STOP_GRACE_S)


def start_deployment(
    gym_config: Mapping[str, Any],
    *,
    policy: PolicyEndpoint,
    venv: Path,
    work_dir: Path,
    host: str,
    port_range: tuple[int, int],
    timeout_s: float,
    policy_adapter: PolicyAdapter,
    server_roots: Sequence[Path],
) -> GymDeployment:
    """Launch one shard's deployment and return it once ready (stopped again if it is not):
    `policy_adapter` is its `policy_model` server, `server_roots` the folders of servers of the
    project's own it may name besides Gym's (module docstring)."""
    try:
        head_port = free_port_in_range(host, *port_range)
    except NoFreePortError as error:
        # A shard that cannot start: the recipe prints it without a traceback.
        raise GymStartError(f"{error} for the Gym head server") from error
    config = deployment_config(
        gym_config,
        policy=policy,
        host=host,
        head_port=head_port,
        port_range=(head_port + 1, port_range[1]),
        server_venvs=link_server_venvs(gym_launcher(venv).parent.parent, server_roots),
        policy_adapter=policy_adapter,
    )
    deployment = GymDeployment(config, venv=venv, work_dir=work_dir, server_roots=server_roots)
    deployment.start(timeout_s)
    return deployment


def agent_urls(head_url: str, *, timeout_s: float) -> dict[str, str]:
    """Agent name -> base URL of every agent server a Gym head server knows (rows name an
    agent by its top-level config name, which Gym calls the process name)."""
    response = httpx.get(f"{head_url.rstrip('/')}/server_instances", timeout=timeout_s)
    response.raise_for_status()
    agents = {
        instance["process_name"]: instance["url"]
        for instance in response.json()
        if instance.get("server_type") == AGENT_KIND and instance.get("url")
    }
    if not agents:
        raise GymStartError(f"the Gym head server at {head_url} lists no agent server")
    return agents


def _gym_environment(server_roots: Sequence[Path]) -> dict[str, str]:
    """This process's environment minus what would pull Gym into the recipe's interpreter or
    its Ray cluster, plus the server roots Gym searches first (none: the variable is left out,
    not set empty). Gym's launcher calls `ray.init()` without an address, which joins the latest
    cluster a `ray start` left on the machine (under launch/ray.sub, the recipe's own, of
    another Ray version); `RAY_ADDRESS=local` makes it start an instance of its own."""
    environment = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("RAY_") and key not in ("PYTHONPATH", "VIRTUAL_ENV", EXTRA_ROOTS_ENV)
    }
    environment["RAY_ADDRESS"] = "local"
    if server_roots:
        environment[EXTRA_ROOTS_ENV] = os.pathsep.join(str(root.resolve()) for root in server_roots)
    return environment

"""SGLang server processes: the command line, one supervised process, a group of them as Ray
actors. The client that talks to them is `gymrl.generation.sglang.engine`.

SGLang's pinned environment conflicts with the recipe's, so nothing here imports it: a server is a
subprocess (`python -m sglang.launch_server`, with `generation.launch.python` or this
interpreter) under the project's one child-process supervisor
(`nemo_gym_ext.processes.ChildProcess`: its own process group, stopped as a group, and by its
guard when its owner dies).

Every server's environment has `SGLANG_RETURN_ORIGINAL_LOGPROB` removed (it would switch the
reported log-probabilities to the pre-temperature distribution; see `sglang_engine`) and the
weight-sync NCCL settings the trainer's rank 0 also runs with
(`gymrl.generation.sglang.weight_sync.WEIGHT_SYNC_NCCL_ENV`). On a CPU (`generation.launch.device:
cpu`) it also gets `SGLANG_USE_CPU_ENGINE=1`, which SGLang needs to choose its CPU platform, and
`OMP_NUM_THREADS` from `launch.cpu_threads`, and at tensor parallelism above 1 what SGLang's CPU
ranks need (:func:`cpu_rank_environment`); `launch.env` is added last.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from gymrl.cluster.placement import RolePlacement, actor_options
from gymrl.config.context_length import sglang_model_overrides
from gymrl.config.schema.generation import SGLangGenerationConfig, SGLangLaunchConfig
from gymrl.config.schema.policy import PolicyConfig
from gymrl.generation.sglang.adapters import AdapterServing
from gymrl.generation.sglang.engine import SGLangError, SGLangTimeoutError
from gymrl.generation.sglang.weight_sync import WEIGHT_SYNC_NCCL_ENV
from nemo_gym_ext.ports import free_port
from nemo_gym_ext.processes import ChildProcess

ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"
CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"
CPU_THREADS_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"
NCCL_LIBRARY_ENV = "SGLANG_NCCL_SO_PATH"
# A path no library is at: SGLang then finds no NCCL and keeps its CPU ranks' groups on gloo.
NO_NCCL_LIBRARY = "/nonexistent/libnccl.so.2"
HEALTH_POLL_INTERVAL_S = 2.0  # the longest pause between health checks (they start at 50 ms)
STOP_GRACE_S = 30.0
# How much longer than generation.server_start_timeout_s the group waits for its servers' actors:
# each actor enforces that deadline itself and names its server's log, which comes first.
START_MARGIN_S = 60.0


def server_command(
    generation: SGLangGenerationConfig,
    policy: PolicyConfig,
    *,
    model_path: str,
    port: int,
    seed: int,
    host: str = "0.0.0.0",
    adapters: AdapterServing | None = None,
) -> list[str]:
    """The `sglang.launch_server` command line of one engine; `adapters`: a LoRA run's
    (`AdapterServing.server_flags`).

    `--skip-tokenizer-init`: the engine is token-in/token-out (the model server renders chat),
    so SGLang never loads a tokenizer and answers with token ids only. The context length is the
    episode's context limit, so a prompt the trainer can take is one SGLang accepts. The servers
    start from `policy.model`'s weights, weight version 0 (`--weight-version`), which every
    answer's `meta_info.weight_version` reports until a refit sets another; the engine checks it.
    """
    launch = generation.launch
    command = [
        launch.python or sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_path,
        "--host",
        host,
        "--port",
        str(port),
        "--tp-size",
        str(generation.tensor_parallel_size),
        "--mem-fraction-static",
        str(generation.mem_fraction_static),
        "--max-running-requests",
        str(generation.max_running_requests),
        "--dtype",
        policy.dtype,
        "--context-length",
        str(policy.max_total_sequence_length),
        "--random-seed",
        str(seed),
        "--skip-tokenizer-init",
        "--weight-version",
        "0",
        "--device",
        launch.device,
    ]
    if launch.attention_backend is not None:
        command += ["--attention-backend", launch.attention_backend]
    if not launch.cuda_graphs:
        command += ["--cuda-graph-backend-decode=disabled", "--cuda-graph-backend-prefill=disabled"]
    if launch.max_total_tokens is not None:
        command += ["--max-total-tokens", str(launch.max_total_tokens)]
    if launch.skip_server_warmup:
        command.append("--skip-server-warmup")
    if launch.deterministic_inference:  # the only mode that honours sampling_seed
        command.append("--enable-deterministic-inference")
    if generation.expert_parallel_size > 1:
        command += ["--ep-size", str(generation.expert_parallel_size)]
    if policy.router_replay.enabled:  # each token's experts, for the trainer to replay
        command.append("--enable-return-routed-experts")
    overrides = sglang_model_overrides(policy)
    if overrides is not None:  # YaRN: the same RoPE scaling Megatron trains with
        command += ["--json-model-override-args", json.dumps(overrides)]
    if adapters is not None:
        command += adapters.server_flags()
    return command


def server_environment(
    gpu_ids: Sequence[int] | None,
    launch: SGLangLaunchConfig | None = None,
    tensor_parallel_size: int = 1,
) -> dict[str, str]:
    """This process's environment as one SGLang server gets it (see the module docstring);
    `tensor_parallel_size`: the server's ranks (`generation.tensor_parallel_size`)."""
    env = dict(os.environ) | dict(WEIGHT_SYNC_NCCL_ENV)
    env.pop(ORIGINAL_LOGPROB_ENV, None)
    if launch is not None:
        if launch.device == "cpu":
            env[CPU_ENGINE_ENV] = "1"
            if launch.cpu_threads is not None:
                env["OMP_NUM_THREADS"] = str(launch.cpu_threads)
            env |= cpu_rank_environment(launch, tensor_parallel_size)
        env |= launch.env
    if gpu_ids is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(gpu) for gpu in gpu_ids)
    return env


def cpu_rank_environment(launch: SGLangLaunchConfig, tensor_parallel_size: int) -> dict[str, str]:
    """What SGLang 0.5.23 needs to run `tensor_parallel_size` > 1 ranks on a CPU.

    * `SGLANG_CPU_OMP_THREADS_BIND`, one `|`-separated core list per rank: without it SGLang
      gives each rank a NUMA node and refuses more ranks than nodes
      (`srt/utils/numa_utils.py`). Rank r gets the r-th block of `launch.cpu_threads` cores
      (`0|1` for two ranks of one thread, `0-7|8-15` for two of eight); without cpu_threads
      SGLang's per-node binding stands.
    * `SGLANG_NCCL_SO_PATH` pointing at no library: the CUDA torch of an SGLang venv ships
      `libnccl.so.2`, so SGLang would give the CPU ranks' groups an NCCL communicator, which
      fails at start-up ("Expected a cuda device, but got: cpu"); finding none, it keeps them on
      gloo.
    """
    if tensor_parallel_size == 1:
        return {}
    env = {NCCL_LIBRARY_ENV: NO_NCCL_LIBRARY}
    threads = launch.cpu_threads
    if threads is not None:
        env[CPU_THREADS_BIND_ENV] = "|".join(
            str(rank * threads) if threads == 1 else f"{rank * threads}-{(rank + 1) * threads - 1}"
            for rank in range(tensor_parallel_size)
        )
    return env


class SGLangServerProcess:
    """One SGLang server subprocess: started on given GPUs, awaited until healthy, stopped.

    It is stopped with its whole process group when the process that started it dies without
    stopping it (`ChildProcess`'s guard). Output goes to `log_path`; its tail is part of every
    start-up error.
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        base_url: str,
        log_path: str | os.PathLike[str],
        gpu_ids: Sequence[int] | None = None,
        launch: SGLangLaunchConfig | None = None,
        tensor_parallel_size: int = 1,
    ) -> None:
        """`launch` and `tensor_parallel_size`: the config the command was made from, for the
        environment it needs."""
        self.base_url = base_url.rstrip("/")
        self.log_path = Path(log_path)
        self._process = ChildProcess(
            command,
            log_path=log_path,
            env=server_environment(gpu_ids, launch, tensor_parallel_size),
            stop_grace_s=STOP_GRACE_S,
        )

    @property
    def command(self) -> list[str]:
        return self._process.command

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def exit_code(self) -> int | None:
        return self._process.exit_code()

    def start(self) -> None:
        self._process.start()

    def wait_healthy(self, timeout_s: float) -> None:
        """Poll `GET /health_generate` until it answers 200; fail fast if the process exits."""
        if not self._process.started:
            raise RuntimeError(f"server {self.base_url} was not started")
        deadline = time.monotonic() + timeout_s
        pause = 0.05
        with httpx.Client(timeout=HEALTH_POLL_INTERVAL_S * 5) as client:
            while True:
                code = self._process.exit_code()
                if code is not None:
                    raise SGLangError(
                        f"SGLang server {self.base_url} exited with code {code} during start-up; "
                        f"last lines of {self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    if client.get(f"{self.base_url}/health_generate").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass  # not listening yet
                if time.monotonic() > deadline:
                    self.stop()
                    raise SGLangTimeoutError(
                        f"SGLang server {self.base_url} was not healthy within "
                        f"generation.server_start_timeout_s={timeout_s} s (loading a large model "
                        f"or compiling CUDA graphs can take minutes: raise it, or read the log); "
                        f"last lines of {self.log_path}:\n{self.log_tail()}"
                    )
                time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
                pause = min(2 * pause, HEALTH_POLL_INTERVAL_S)

    def stop(self, timeout_s: float = STOP_GRACE_S) -> None:
        """SIGTERM the server's process group, then SIGKILL what is left after `timeout_s`."""
        self._process.stop(timeout_s)

    def log_tail(self) -> str:
        return self._process.log_tail()

    def __enter__(self) -> SGLangServerProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class SGLangServerActor:
    """Body of a Ray actor that owns one SGLang server on the GPUs Ray gave it.

    Started by :class:`SGLangServerGroup` with `tensor_parallel_size` GPUs of one placement
    bundle, so the whole TP group is on one node; Ray sets `CUDA_VISIBLE_DEVICES`, which the
    server inherits (a CPU server, `launch.device: cpu`, takes no GPU and no bundle). The server
    listens on the node address it is reached at.
    """

    def __init__(
        self,
        generation: SGLangGenerationConfig,
        policy: PolicyConfig,
        *,
        model_path: str,
        seed: int,
        log_path: str,
        adapters: AdapterServing | None = None,
    ) -> None:
        """`adapters`: a LoRA run's (`server_command`)."""
        import ray  # a Ray worker process always has it

        port = free_port()
        host = ray.util.get_node_ip_address()
        command = server_command(
            generation,
            policy,
            model_path=model_path,
            port=port,
            seed=seed,
            host=host,
            adapters=adapters,
        )
        self._server = SGLangServerProcess(
            command,
            base_url=f"http://{host}:{port}",
            log_path=log_path,
            launch=generation.launch,
            tensor_parallel_size=generation.tensor_parallel_size,
        )
        self._server.start()
        self._server.wait_healthy(generation.server_start_timeout_s)

    def url(self) -> str:
        return self._server.base_url

    def stop(self) -> None:
        self._server.stop()


class SGLangServerGroup:
    """`generation.num_engines` SGLang servers as Ray actors, where `gymrl.cluster.placement`
    puts them.

    The run's placement group holds one `tensor_parallel_size`-GPU bundle per engine, so Ray
    places each TP group on one node. Needs a running Ray cluster with the GPUs. Each engine gets
    its own seed (`seed + index`), so engines do not sample identical continuations of identical
    prompts.
    """

    def __init__(
        self,
        generation: SGLangGenerationConfig,
        policy: PolicyConfig,
        *,
        model_path: str,
        seed: int,
        log_dir: str | os.PathLike[str],
        placement_group: Any,
        engines: RolePlacement,
        adapters: AdapterServing | None = None,
    ) -> None:
        """`adapters`: a LoRA run's, started on every server (`server_command`)."""
        import ray

        self._ray = ray
        actor_class = ray.remote(SGLangServerActor)
        self._actors = [
            actor_class.options(**actor_options(engines, index, placement_group)).remote(
                generation,
                policy,
                model_path=model_path,
                seed=seed + index,
                log_path=str(Path(log_dir) / f"sglang_engine_{index}.log"),
                adapters=adapters,
            )
            for index in range(generation.num_engines)
        ]
        # Start-up (model load, CUDA graphs) runs in parallel; each actor enforces the deadline
        # on its server (naming its log), and this wait, START_MARGIN_S longer, names the
        # servers whose actor did not answer at all (one that could not be placed, or hangs).
        # A group that fails to start ends its actors: no caller holds it to shut it down.
        try:
            self.urls: list[str] = _wait_for_servers(
                [actor.url.remote() for actor in self._actors],
                timeout_s=generation.server_start_timeout_s + START_MARGIN_S,
                what=f"the SGLang servers' start (generation.server_start_timeout_s + "
                f"{START_MARGIN_S:g} s)",
            )
        except BaseException:
            self._kill_actors()
            raise

    def shutdown(self, timeout_s: float = 4 * STOP_GRACE_S + 10.0) -> None:
        """Stop the servers and end their actors, also when a stop fails or outlives
        `timeout_s` (then raised once the actors are killed); the placement group is the run's."""
        try:
            _wait_for_servers(
                [actor.stop.remote() for actor in self._actors],
                timeout_s=timeout_s,
                what="stopping the SGLang servers",
            )
        finally:
            self._kill_actors()

    def _kill_actors(self) -> None:
        for actor in self._actors:
            # Ray types a created actor as `ActorHandle | type[cls]` (so its methods type-check);
            # kill takes the handle, which is what it is at run time.
            self._ray.kill(actor)  # pyright: ignore[reportArgumentType]


def _wait_for_servers(refs: list[Any], *, timeout_s: float, what: str) -> list[Any]:
    """One call to every server's actor within one deadline: `wait_for_all`, whose TimeoutError
    names `what`, the deadline and the servers that had not answered ("SGLang server 1 (of 2)"),
    and which raises a server's own error (its log's tail) rather than Ray's wrapper of it. It
    runs in the generation server's actor, where no watchdog or stop handler is installed, so
    its slices only bound the wait."""
    from gymrl.cluster.ray_calls import wait_for_all  # imports Ray, which a dry run must not

    return wait_for_all(refs, timeout_s=timeout_s, what=what, member="SGLang server")

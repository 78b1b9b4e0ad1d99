"""What the launcher gives an SGLang server of an MoE policy: the routed-experts switch for router
replay, and the environment SGLang's ranks need on a CPU at tensor parallelism above 1 (which
expert parallelism runs inside). The real server takes both in `test_moe_cpu.py`."""

from __future__ import annotations

import json
import sys
import time

from gymrl.config.schema.generation import SGLangGenerationConfig, SGLangLaunchConfig
from gymrl.config.schema.policy import PolicyConfig
from gymrl.generation.sglang.servers import (
    CPU_THREADS_BIND_ENV,
    NCCL_LIBRARY_ENV,
    SGLangServerProcess,
    server_command,
    server_environment,
)

CPU = SGLangLaunchConfig(device="cpu", cpu_threads=1)


def _moe_policy(*, router_replay: bool) -> PolicyConfig:
    return PolicyConfig(
        name="m",
        source="tiny_random_moe",
        is_moe=True,
        max_total_sequence_length=2048,
        router_replay={"enabled": router_replay},
    )


def test_router_replay_asks_the_server_for_each_tokens_experts():
    generation = SGLangGenerationConfig(tensor_parallel_size=2, expert_parallel_size=2)
    replayed = server_command(
        generation, _moe_policy(router_replay=True), model_path="/m", port=1, seed=0
    )
    plain = server_command(
        generation, _moe_policy(router_replay=False), model_path="/m", port=1, seed=0
    )
    assert "--enable-return-routed-experts" in replayed
    assert "--enable-return-routed-experts" not in plain
    assert plain[plain.index("--ep-size") + 1] == "2"


def test_cpu_ranks_get_a_block_of_cores_each_and_no_nccl():
    assert server_environment(None, CPU, 2)[CPU_THREADS_BIND_ENV] == "0|1"
    wide = CPU.model_copy(update={"cpu_threads": 4})
    assert server_environment(None, wide, 3)[CPU_THREADS_BIND_ENV] == "0-3|4-7|8-11"
    assert server_environment(None, wide, 3)[NCCL_LIBRARY_ENV] == "/nonexistent/libnccl.so.2"
    # Without cpu_threads SGLang's own binding (a NUMA node per rank) stands; NCCL still goes.
    unbound = server_environment(None, CPU.model_copy(update={"cpu_threads": None}), 2)
    assert CPU_THREADS_BIND_ENV not in unbound and NCCL_LIBRARY_ENV in unbound
    # launch.env comes last, so a binding of one's own wins.
    own = CPU.model_copy(update={"env": {CPU_THREADS_BIND_ENV: "2|3"}})
    assert server_environment(None, own, 2)[CPU_THREADS_BIND_ENV] == "2|3"


def test_one_cpu_rank_and_gpu_servers_are_left_as_they_were():
    for env in (
        server_environment(None, CPU, 1),
        server_environment([0, 1], SGLangLaunchConfig(), 2),
        server_environment([0, 1]),
    ):
        assert CPU_THREADS_BIND_ENV not in env and NCCL_LIBRARY_ENV not in env


# The server "process": prints the two variables as JSON and exits.
_PRINT_ENV = (
    "import json, os; print(json.dumps({k: os.environ.get(k) for k in "
    f"({CPU_THREADS_BIND_ENV!r}, {NCCL_LIBRARY_ENV!r})}}))"
)


def test_the_server_process_starts_with_its_ranks_environment(tmp_path):
    log = tmp_path / "server.log"
    server = SGLangServerProcess(
        [sys.executable, "-c", _PRINT_ENV],
        base_url="http://127.0.0.1:1",
        log_path=log,
        launch=CPU,
        tensor_parallel_size=2,
    )
    server.start()
    deadline = time.monotonic() + 60
    while server.exit_code() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.exit_code() == 0, server.log_tail()
    seen = json.loads(log.read_text().strip().splitlines()[-1])
    assert seen == {CPU_THREADS_BIND_ENV: "0|1", NCCL_LIBRARY_ENV: "/nonexistent/libnccl.so.2"}

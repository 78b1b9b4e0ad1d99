"""The real SGLang 0.5.23 server on this CPU, started by the project's launcher: shared by the
`sglang_cpu` tests and `benchmarks/bench_sglang_cpu.py`.

The server runs from the venv `make sglang-venv` builds (`SGLANG_VENV`, default `.venv-sglang`)
with `generation=sglang_cpu`, the CPU experiments' own generation config, which puts the
`sgl_kernel` stand-in and the MoE path's CPU stand-ins (`cpu_standins/sglang_server/`) on its
PYTHONPATH.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cpu_standins.sglang_server.sglang_moe_on_cpu import WEIGHT_COMPARE_ENV
from gymrl.config.compose import compose_raw
from gymrl.config.schema.generation import SGLangGenerationConfig
from gymrl.config.schema.policy import PolicyConfig
from gymrl.generation.sglang.adapters import AdapterServing
from gymrl.generation.sglang.servers import SGLangServerProcess, server_command
from nemo_gym_ext.ports import free_port

REPO = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("SGLANG_VENV", REPO / ".venv-sglang"))
KERNEL_STANDIN = REPO / "cpu_standins" / "sglang_server"  # what sglang_cpu.yaml's PYTHONPATH names
# Switches on the stand-in's weight compare where the weights are (`sglang_moe_on_cpu.py`).
CPU_WEIGHT_COMPARE_ENV = WEIGHT_COMPARE_ENV


def cpu_generation(cpu_threads: int = 1) -> SGLangGenerationConfig:
    """`generation=sglang_cpu` (conf/generation/sglang_cpu.yaml; float32 comes from the policy)
    from this venv, on `cpu_threads`, with the tests' own deadlines and bucket: a server that is
    not healthy in 5 minutes or a refit call unanswered in one fails the test sooner than a run's
    deadlines would, and refits go in 64 MiB buckets (as benchmarks/README.md measured them)."""
    raw = compose_raw(
        [
            "generation=sglang_cpu",
            f"generation.launch.python={VENV / 'bin' / 'python'}",
            f"generation.launch.cpu_threads={cpu_threads}",
            "generation.server_start_timeout_s=300",
            "generation.refit.timeout_s=60",
            f"generation.refit.bucket_bytes={64 << 20}",
        ]
    )
    return SGLangGenerationConfig.model_validate(raw["generation"])


@contextmanager
def kernel_standin_on_path() -> Iterator[None]:
    """While a server is made: its environment is copied from this process's then. For a
    server whose config does not name the stand-ins itself (generation=sglang_cpu does)."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(KERNEL_STANDIN), before]))
    try:
        yield
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def start_cpu_server(
    folder: Path,
    log_path: Path,
    *,
    context_length: int,
    cpu_threads: int = 1,
    routed_experts: bool = False,
    weight_compare: bool = False,
    adapters: AdapterServing | None = None,
    **generation_overrides: Any,
) -> SGLangServerProcess:
    """A healthy real server of the model in `folder` on a free loopback port; stop it.
    `routed_experts`: launched for router replay (each answer can carry each token's experts);
    `weight_compare`: the weight checker's compare runs on this CPU (the stand-in's); else it
    cannot, as in SGLang 0.5.23; `adapters`: launched for a LoRA run's adapters;
    `generation_overrides`: fields of :func:`cpu_generation`'s
    config (e.g. tensor and expert parallelism)."""
    if not (VENV / "bin" / "python").is_file():
        raise FileNotFoundError(f"no SGLang venv at {VENV}: run `make sglang-venv`")
    generation = SGLangGenerationConfig.model_validate(
        cpu_generation(cpu_threads).model_dump() | generation_overrides
    )
    if weight_compare:
        env = generation.launch.env | {CPU_WEIGHT_COMPARE_ENV: "1"}
        launch = generation.launch.model_copy(update={"env": env})
        generation = generation.model_copy(update={"launch": launch})
    policy = PolicyConfig(
        name=folder.name,
        source="pretrained",
        path=str(folder),
        max_total_sequence_length=context_length,
        is_moe=routed_experts,
        router_replay={"enabled": routed_experts},
    )
    port = free_port()
    command = server_command(
        generation,
        policy,
        model_path=str(folder),
        port=port,
        seed=0,
        host="127.0.0.1",
        adapters=adapters,
    )
    server = SGLangServerProcess(
        command,
        base_url=f"http://127.0.0.1:{port}",
        log_path=log_path,
        launch=generation.launch,  # its env puts the CPU stand-ins on the server's PYTHONPATH
        tensor_parallel_size=generation.tensor_parallel_size,
    )
    server.start()
    try:
        server.wait_healthy(generation.server_start_timeout_s)
    except BaseException:
        server.stop()
        raise
    return server

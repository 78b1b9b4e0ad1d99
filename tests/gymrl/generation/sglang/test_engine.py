"""The SGLang client against a stand-in server on loopback (`sglang_standin`, which reproduces
the pinned server's refit behaviours), and against real SGLang on a GPU."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from gymrl.config.schema.generation import SGLangGenerationConfig, SGLangLaunchConfig
from gymrl.config.schema.policy import PolicyConfig
from gymrl.generation.sglang import engine as sglang_engine
from gymrl.generation.sglang.engine import (
    SGLangEngine,
    SGLangError,
    SGLangTimeoutError,
    remove_loaded_refits,
)
from gymrl.generation.sglang.servers import (
    ORIGINAL_LOGPROB_ENV,
    SGLangServerProcess,
    server_command,
    server_environment,
)
from gymrl.generation.types import GenerationRequest, SamplingParams, UnsupportedRequestError
from nemo_gym_ext.ports import free_port
from tests.support.sglang_standin import WEIGHT_OFFSET


@pytest.fixture
def weights_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(4, 2)}, str(folder / "model.safetensors"))
    return folder


def _request(prompt, max_new_tokens=4, **params) -> GenerationRequest:
    return GenerationRequest(prompt, SamplingParams(max_new_tokens=max_new_tokens, **params))


def _engine(urls, **kwargs) -> SGLangEngine:
    kwargs.setdefault("request_timeout_s", 10.0)
    kwargs.setdefault("refit_timeout_s", 10.0)
    return SGLangEngine(urls, **kwargs)


# ------------------------------------------------------------------------------------- tests
def test_generate_sends_sglang_fields_and_parses_logprobs(standin):
    url, state = standin()
    with _engine([url], honours_seeds=True) as engine:
        [out] = engine.generate(
            [_request([5, 6, 7], max_new_tokens=3, temperature=0.7, top_p=0.9, seed=11)]
        )
    [(_, body)] = state.events
    assert body == {
        "input_ids": [5, 6, 7],
        "sampling_params": {
            "max_new_tokens": 3,
            "temperature": 0.7,
            "top_p": 0.9,
            "sampling_seed": 11,
        },
        "return_logprob": True,
        "logprob_start_len": -1,
    }
    assert out.token_ids == [3, 4, 5]
    assert out.logprobs == [-0.4, -0.5, -0.6]
    assert out.finish_reason == "length"
    assert out.prompt_token_ids == [5, 6, 7]
    assert out.weight_version == 0


def test_stop_token_is_kept_and_maps_to_stop(standin):
    url, state = standin()
    with _engine([url]) as engine:
        stopped, ran_out = engine.generate(
            [
                _request([1, 2], max_new_tokens=10, stop_token_ids=(4, 99)),
                _request([1], max_new_tokens=2, stop_token_ids=(99,)),
            ]
        )
    assert stopped.token_ids == [2, 3, 4] and stopped.finish_reason == "stop"
    assert len(stopped.logprobs) == 3
    assert ran_out.token_ids == [1, 2] and ran_out.finish_reason == "length"
    sent = {tuple(body["input_ids"]): body for _, body in state.events}
    assert sent[(1, 2)]["sampling_params"]["stop_token_ids"] == [4, 99]


def test_requests_spread_over_servers(standin):
    (url_a, state_a), (url_b, state_b) = standin(token_delay_s=0.05), standin(token_delay_s=0.05)
    with _engine([url_a, url_b]) as engine:
        outputs = engine.generate([_request([i + 1] * (i + 1), max_new_tokens=2) for i in range(4)])
    assert [len(out.token_ids) for out in outputs] == [2, 2, 2, 2]
    assert [out.prompt_token_ids for out in outputs] == [[i + 1] * (i + 1) for i in range(4)]
    assert len(state_a.events) == 2 and len(state_b.events) == 2


def test_server_error_names_server_and_message(standin):
    url, _ = standin(context_length=8)
    with _engine([url]) as engine, pytest.raises(SGLangError, match="longer than the model's"):
        engine.generate([_request(list(range(1, 20)))])


def test_timeout_raises_clear_error(standin):
    url, _ = standin(token_delay_s=0.5)
    with (
        _engine([url], request_timeout_s=0.2) as engine,
        pytest.raises(SGLangTimeoutError, match=r"/generate did not answer within 0.2 s"),
    ):
        engine.generate([_request([1], max_new_tokens=2)])


def test_unreachable_server_is_a_clear_error():
    with (
        _engine([f"http://127.0.0.1:{free_port()}"]) as engine,
        pytest.raises(SGLangError, match="POST /generate failed: ConnectError"),
    ):
        engine.generate([_request([1])])


def test_invalid_request_rejected_before_sending(standin):
    url, state = standin()
    with _engine([url]) as engine, pytest.raises(ValueError, match=r"requests\[1\].params.top_p"):
        engine.generate([_request([1]), _request([1], top_p=0.0)])
    assert state.events == []


def test_refit_sequence_order_and_version(standin, weights_dir):
    (url_a, state_a), (url_b, state_b) = standin(), standin()
    with _engine([url_a, url_b]) as engine:
        engine.refit_from_disk(weights_dir, 3)
        assert engine.weight_version == 3
        [out] = engine.generate([_request([1, 1], max_new_tokens=1)])
    for state in (state_a, state_b):
        assert [kind for kind, _ in state.events[:4]] == ["pause", "update", "flush", "continue"]
        assert state.events[0][1] == "abort"
        assert state.events[1][1]["model_path"] == str(weights_dir.resolve())
        assert state.events[1][1]["weight_version"] == "3"
    assert out.token_ids == [2 + 3 * WEIGHT_OFFSET] and out.weight_version == 3


def test_generation_interrupted_by_refit_resumes_under_new_weights(standin, weights_dir):
    url, state = standin(token_delay_s=0.02)
    with _engine([url]) as engine:
        result = {}
        worker = threading.Thread(
            target=lambda: result.update(out=engine.generate([_request([9, 9], 30)])[0])
        )
        worker.start()
        deadline = time.monotonic() + 10
        while state.tokens_sampled < 5:  # refit only once the generation is under way
            assert time.monotonic() < deadline, "the stand-in server did not start generating"
            time.sleep(0.01)
        engine.refit_from_disk(weights_dir, 1)
        worker.join(10)
    out = result["out"]
    first, resumed = (body for kind, body in state.events if kind == "generate")
    partial = len(resumed["input_ids"]) - 2
    assert 0 < partial < 30
    assert resumed["input_ids"] == [9, 9, *out.token_ids[:partial]]
    assert resumed["sampling_params"]["max_new_tokens"] == 30 - partial
    assert len(out.token_ids) == len(out.logprobs) == 30
    # Tokens before the refit come from the old weights, the rest from the new ones.
    assert out.token_ids[:partial] == list(range(2, 2 + partial))
    assert out.token_ids[partial:] == [WEIGHT_OFFSET + 2 + i for i in range(partial, 30)]
    assert out.finish_reason == "length" and out.weight_version == 0
    assert first["input_ids"] == [9, 9]


def _generate_in_thread(engine: SGLangEngine, request: GenerationRequest):
    """Start `engine.generate([request])` on a thread; returns (thread, result dict)."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["out"] = engine.generate([request])[0]
        except Exception as error:  # reported by the test that joins
            result["error"] = error

    worker = threading.Thread(target=run)
    worker.start()
    return worker, result


def _join(thread: threading.Thread, timeout_s: float = 60.0) -> None:
    thread.join(timeout_s)
    assert not thread.is_alive(), f"{thread.name} did not finish within {timeout_s} s"


def _wait_until(condition, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_stop_token_decoded_after_an_abort_ends_the_turn(standin, weights_dir):
    """SGLang decodes once more after an abort and keeps that token even when it is the stop
    token; the engine ends the turn there instead of resuming past the end of the turn."""
    url, state = standin(token_delay_s=1.0)  # the pause has a second to land between tokens
    with _engine([url]) as engine:
        # Tokens are 2, 3, 4, 5, ...: the refit lands after three, the fourth is the stop token.
        worker, result = _generate_in_thread(engine, _request([9, 9], 10, stop_token_ids=(5,)))
        _wait_until(lambda: state.tokens_sampled == 3, "the stand-in did not start generating")
        engine.refit_from_disk(weights_dir, 1)
        _join(worker)
    out = result["out"]
    assert state.finishes == [{"type": "abort", "message": "Aborted", **_NO_STATUS}]
    assert out.token_ids == [2, 3, 4, 5] and len(out.logprobs) == 4
    assert out.finish_reason == "stop"
    assert [kind for kind, _ in state.events].count("generate") == 1  # not resumed


def test_a_model_end_token_decoded_after_an_abort_ends_the_turn_too(standin, weights_dir):
    """SGLang also stops at the model's own end ids (Qwen3's generation config adds 151643),
    which the request need not list: the abort cut stops there as well."""
    url, state = standin(token_delay_s=1.0, end_token_ids=(5,))
    with _engine([url], end_token_ids=[5]) as engine:
        worker, result = _generate_in_thread(engine, _request([9, 9], 10, stop_token_ids=(77,)))
        _wait_until(lambda: state.tokens_sampled == 3, "the stand-in did not start generating")
        engine.refit_from_disk(weights_dir, 1)
        _join(worker)
    out = result["out"]
    assert state.finishes == [{"type": "abort", "message": "Aborted", **_NO_STATUS}]
    assert out.token_ids == [2, 3, 4, 5] and out.finish_reason == "stop"
    assert [kind for kind, _ in state.events].count("generate") == 1  # not resumed past it


def test_prompt_plus_max_new_tokens_beyond_the_context_is_refused(standin):
    url, _ = standin(context_length=16)
    with _engine([url]) as engine:
        with pytest.raises(SGLangError, match=r"400.*maximum context length of 16 tokens"):
            engine.generate([_request([1] * 10, max_new_tokens=7)])
        [out] = engine.generate([_request([1] * 10, max_new_tokens=6)])
    assert len(out.token_ids) == 6


def test_a_disk_refit_leaves_the_flush_to_end_refit(standin, weights_dir):
    """An update that asks for a flush fails when the scheduler refuses it (requests not yet
    gone after the pause), although the weights loaded; the engine asks for none and flushes
    with retries after."""
    url, state = standin(flush_refusals=2)
    with _engine([url]) as engine:
        engine.refit_from_disk(weights_dir, 1)
        assert engine.weight_version == 1
    [update] = [body for kind, body in state.events if kind == "update"]
    assert update["flush_cache"] is False
    assert [kind for kind, _ in state.events].count("flush") == 3


_NO_STATUS = {"status_code": None, "err_type": None}


def test_request_admitted_between_refit_start_and_pause_is_resumed(standin, weights_dir):
    """The refit has begun but the server has not paused yet: a request sent now is admitted,
    then aborted by the pause; it is resumed under the new weights, not failed."""
    # The generation (200 x 20 ms) outlasts the pause's delay (1.5 s) by a margin.
    url, state = standin(token_delay_s=0.02, pause_delay_s=1.5)
    with _engine([url]) as engine:
        refit = threading.Thread(target=engine.refit_from_disk, args=(weights_dir, 1))
        refit.start()
        _wait_until(state.pause_requested.is_set, "the refit did not reach the server")
        worker, result = _generate_in_thread(engine, _request([9, 9], 200))
        _join(refit)
        _join(worker)
    assert "error" not in result, result.get("error")
    out = result["out"]
    assert [finish["type"] for finish in state.finishes] == ["abort", "length"], state.finishes
    assert len(out.token_ids) == 200 and out.token_ids[-1] == WEIGHT_OFFSET + 2 + 199
    assert out.weight_version == 0  # its first tokens came from the old weights


def test_abort_without_a_refit_is_an_error(standin):
    url, state = standin(token_delay_s=0.05)
    with _engine([url]) as engine:
        worker, result = _generate_in_thread(engine, _request([9, 9], 30))
        _wait_until(lambda: state.tokens_sampled > 0, "the stand-in did not start generating")
        state.abort_count += 1  # what an admin's /abort_request does
        _join(worker)
    assert isinstance(result["error"], SGLangError)
    assert "aborted the request: Aborted" in str(result["error"])


def test_flush_cache_refusals_are_retried(standin, weights_dir):
    url, state = standin(flush_refusals=3)
    with _engine([url]) as engine:
        engine.refit_from_disk(weights_dir, 2)
        assert engine.weight_version == 2
    kinds = [kind for kind, _ in state.events]
    assert kinds == ["pause", "update", "flush", "flush", "flush", "flush", "continue"]


def test_flush_cache_refused_past_its_deadline_fails_the_refit(standin, weights_dir, monkeypatch):
    monkeypatch.setattr(sglang_engine, "FLUSH_DEADLINE_S", 0.3)
    url, state = standin(flush_refusals=1000)
    with (
        _engine([url]) as engine,
        pytest.raises(SGLangError, match=r"/flush_cache answered 400 for 0\.3 s"),
    ):
        engine.refit_from_disk(weights_dir, 2)
    assert engine.weight_version == 0 and state.paused


def test_failed_refit_keeps_version_and_leaves_servers_paused(standin, tmp_path):
    url, state = standin()
    with _engine([url]) as engine:
        with pytest.raises(SGLangError, match="update_weights_from_disk answered 400"):
            engine.refit_from_disk(tmp_path / "empty", 5)
        assert engine.weight_version == 0
    assert state.paused and [kind for kind, _ in state.events] == ["pause", "update"]


def test_update_weights_writes_safetensors_and_refits(standin, tmp_path):
    url, state = standin()
    embedding = torch.randn(6, 3)
    state_dict = {"model.embed_tokens.weight": embedding, "lm_head.weight": embedding}  # tied
    with _engine([url], refit_dir=tmp_path / "refit") as engine:
        engine.update_weights(state_dict, 1)
        assert state.loaded_tensors == ["lm_head.weight", "model.embed_tokens.weight"]
        assert (tmp_path / "refit" / "weights_v1").is_dir()
        engine.update_weights(state_dict, 2)
        assert engine.weight_version == 2
    assert sorted(p.name for p in (tmp_path / "refit").iterdir()) == ["weights_v2"]
    written = load_file(str(tmp_path / "refit" / "weights_v2" / "model.safetensors"))
    assert torch.equal(written["lm_head.weight"], embedding)


def test_update_weights_without_refit_dir_is_a_clear_error(standin):
    url, _ = standin()
    with _engine([url]) as engine, pytest.raises(ValueError, match="needs refit_dir"):
        engine.update_weights({"w": torch.zeros(1)}, 1)


def test_from_config_checks_engine_count():
    generation = SGLangGenerationConfig(num_engines=2)
    with pytest.raises(ValueError, match=r"generation\.num_engines=2"):
        SGLangEngine.from_config(generation, ["http://a:1"])


# ------------------------------------------------------------------------- server processes
def _policy(**kwargs) -> PolicyConfig:
    fields = dict(name="m", source="pretrained", path="/m", max_total_sequence_length=4096)
    return PolicyConfig(**(fields | kwargs))


def test_server_command_maps_config_to_sglang_flags():
    generation = SGLangGenerationConfig(
        num_engines=2,
        tensor_parallel_size=4,
        expert_parallel_size=4,
        mem_fraction_static=0.75,
        max_running_requests=128,
    )
    command = server_command(
        generation, _policy(dtype="bfloat16"), model_path="/ckpt", port=30001, seed=7
    )
    assert command[1:3] == ["-m", "sglang.launch_server"]
    flags = {
        flag: value
        for flag, value in zip(command[3:], [*command[4:], None], strict=True)
        if flag.startswith("--") and value is not None and not value.startswith("--")
    }
    assert flags["--model-path"] == "/ckpt" and flags["--port"] == "30001"
    assert flags["--host"] == "0.0.0.0"
    assert flags["--tp-size"] == "4" and flags["--ep-size"] == "4"
    assert flags["--mem-fraction-static"] == "0.75"
    assert flags["--max-running-requests"] == "128"
    assert flags["--dtype"] == "bfloat16" and flags["--context-length"] == "4096"
    assert flags["--random-seed"] == "7"
    assert "--skip-tokenizer-init" in command
    dense = server_command(
        SGLangGenerationConfig(num_engines=1), _policy(), model_path="/c", port=1, seed=0
    )
    assert "--ep-size" not in dense


def test_server_command_takes_cpu_flags_from_config():
    """The real server on a CPU is the flagship's launcher with another launch config."""
    launch = SGLangLaunchConfig(
        python="/venv/bin/python",
        device="cpu",
        cpu_threads=1,
        attention_backend="torch_native",
        cuda_graphs=False,
        max_total_tokens=4096,
        skip_server_warmup=True,
    )
    generation = SGLangGenerationConfig(launch=launch)
    command = server_command(generation, _policy(), model_path="/c", port=1, seed=0)
    assert command[0] == "/venv/bin/python"
    assert command[command.index("--device") + 1] == "cpu"
    assert command[command.index("--attention-backend") + 1] == "torch_native"
    assert command[command.index("--max-total-tokens") + 1] == "4096"
    assert command[command.index("--weight-version") + 1] == "0"
    assert "--cuda-graph-backend-decode=disabled" in command
    assert "--cuda-graph-backend-prefill=disabled" in command
    assert "--skip-server-warmup" in command
    assert "--enable-deterministic-inference" not in command
    env = server_environment(None, launch)
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["OMP_NUM_THREADS"] == "1"
    with_env = launch.model_copy(update={"env": {"OMP_NUM_THREADS": "2", "X": "y"}})
    assert server_environment(None, with_env)["OMP_NUM_THREADS"] == "2"  # launch.env comes last
    assert server_environment(None, with_env)["X"] == "y"
    default = server_command(SGLangGenerationConfig(), _policy(), model_path="/c", port=1, seed=0)
    assert default[0] == sys.executable and default[default.index("--device") + 1] == "cuda"
    for flag in ("--attention-backend", "--max-total-tokens", "--skip-server-warmup"):
        assert flag not in default
    assert not any(flag.startswith("--cuda-graph") for flag in default)
    assert "SGLANG_USE_CPU_ENGINE" not in server_environment(None, SGLangLaunchConfig())


def test_sampling_seeds_need_deterministic_inference(standin):
    """SGLang honours `sampling_seed` only under --enable-deterministic-inference; without it a
    seeded request is refused by name, not sampled with another seed."""
    deterministic = SGLangGenerationConfig(launch={"deterministic_inference": True})
    command = server_command(deterministic, _policy(), model_path="/c", port=1, seed=0)
    assert "--enable-deterministic-inference" in command
    url, state = standin()
    with SGLangEngine.from_config(SGLangGenerationConfig(), [url]) as engine:
        with pytest.raises(UnsupportedRequestError, match=r"deterministic_inference=true") as no:
            engine.generate([_request([1, 2], seed=3)])
        assert no.value.param == "seed"
        assert state.events == []
    with SGLangEngine.from_config(deterministic, [url]) as engine:
        engine.generate([_request([1, 2], seed=3)])
    [(_, body)] = state.events
    assert body["sampling_params"]["sampling_seed"] == 3


def test_deterministic_inference_with_an_attention_backend_sglang_refuses_it_fails_early():
    with pytest.raises(ValueError, match=r"deterministic_inference.*torch_native"):
        SGLangLaunchConfig(deterministic_inference=True, attention_backend="torch_native")


def test_a_server_listed_twice_is_refused():
    """Two concurrent updates to one SGLang server break it (InvalidStateError)."""
    with pytest.raises(ValueError, match=r"lists \['http://a:1'\] more than once"):
        SGLangEngine(
            ["http://a:1", "http://b:2", "http://a:1/"], request_timeout_s=1, refit_timeout_s=1
        )


def test_an_answer_from_other_weights_than_the_engines_stops_generation(standin):
    """A server that restarted (version 0 again) or missed a refit answers with another
    `meta_info.weight_version` than the engine's servers hold."""
    url, state = standin()
    with _engine([url]) as engine:
        [out] = engine.generate([_request([1, 2])])
        assert out.weight_version == 0
        state.weight_version = "7"  # not a version this engine ever loaded
        with pytest.raises(
            SGLangError, match=r"weight_version '7', but this engine's servers hold version 0"
        ):
            engine.generate([_request([1, 2])])


_HEALTH_ONLY_SERVER = """
import http.server, sys
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health_generate" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def test_server_process_waits_for_health_and_stops(tmp_path):
    port = free_port()
    command = [sys.executable, "-c", _HEALTH_ONLY_SERVER, str(port)]
    server = SGLangServerProcess(
        command, base_url=f"http://127.0.0.1:{port}", log_path=tmp_path / "s.log"
    )
    with server:
        server.start()
        server.wait_healthy(timeout_s=20)
        assert server.exit_code() is None
    assert server.exit_code() is not None


def test_server_process_exit_reports_log_and_clean_env(tmp_path, monkeypatch):
    monkeypatch.setenv(ORIGINAL_LOGPROB_ENV, "1")
    script = (
        "import os, sys; print('env', os.environ.get('SGLANG_RETURN_ORIGINAL_LOGPROB', 'unset'),"
        " os.environ['CUDA_VISIBLE_DEVICES']); sys.exit(3)"
    )
    server = SGLangServerProcess(
        [sys.executable, "-c", script],
        base_url=f"http://127.0.0.1:{free_port()}",
        log_path=tmp_path / "s.log",
        gpu_ids=[2, 3],
    )
    server.start()
    with pytest.raises(SGLangError, match=r"exited with code 3[\s\S]*env unset 2,3"):
        server.wait_healthy(timeout_s=20)


def test_server_process_health_deadline_kills_it(tmp_path):
    server = SGLangServerProcess(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        base_url=f"http://127.0.0.1:{free_port()}",
        log_path=tmp_path / "s.log",
    )
    server.start()
    with pytest.raises(SGLangTimeoutError, match=r"server_start_timeout_s=0\.3"):
        server.wait_healthy(timeout_s=0.3)
    assert server.exit_code() is not None


# A stand-in for the Ray actor that owns a server: starts one, prints its pid, waits to be killed.
_SERVER_OWNER = """
import sys, time
from gymrl.generation.sglang.servers import SGLangServerProcess
server = SGLangServerProcess(
    [sys.executable, "-c", "import time; time.sleep(600)"],
    base_url="http://127.0.0.1:1",
    log_path=sys.argv[1],
)
server.start()
print(server.pid, flush=True)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie (an orphan's reaper may be slow or absent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux-only")
def test_server_dies_with_the_process_that_started_it(tmp_path):
    """kill -9 of the owner (as `ray.kill` or a crashed worker does) takes its server along,
    although the server runs in its own process group and nobody calls stop()."""
    repo = Path(__file__).resolve().parents[4]
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])
    }
    owner = subprocess.Popen(
        [sys.executable, "-c", _SERVER_OWNER, str(tmp_path / "s.log")],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    server_pid = None
    try:
        assert owner.stdout is not None
        server_pid = int(owner.stdout.readline())
        assert _running(server_pid) and os.getpgid(server_pid) == server_pid
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 10
        while _running(server_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(server_pid)
    finally:
        owner.kill()
        owner.wait()
        if server_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server_pid, signal.SIGKILL)  # only if the test failed


# -------------------------------------------------------------------------------- real SGLang
def _real_sglang_checkpoint() -> Path:
    import importlib.util

    if not torch.cuda.is_available():
        pytest.skip(
            "the bfloat16 check on a GPU; the real server on this CPU is test_sglang_cpu.py's "
            "(-m sglang_cpu)"
        )
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed (the sglang role: locks/sglang.txt, docs/cluster.md)")
    from gymrl.model.loading import ensure_smollm2_checkpoint

    try:
        return ensure_smollm2_checkpoint("~/.cache/gym-grpo-recipes/models")
    except FileNotFoundError as error:
        pytest.skip(f"no small local model for SGLang: {error}")


@pytest.mark.gpu
def test_real_sglang_logprobs_match_temperature_scaled_softmax_and_refit(tmp_path):
    checkpoint = _real_sglang_checkpoint()
    from gymrl.model.loading import load_pretrained

    generation = SGLangGenerationConfig(num_engines=1, mem_fraction_static=0.3)
    policy = _policy(path=str(checkpoint), dtype="bfloat16", max_total_sequence_length=2048)
    port = free_port()
    command = server_command(generation, policy, model_path=str(checkpoint), port=port, seed=0)
    with SGLangServerProcess(
        command, base_url=f"http://127.0.0.1:{port}", log_path=tmp_path / "sglang.log"
    ) as server:
        server.start()
        server.wait_healthy(generation.server_start_timeout_s)
        with SGLangEngine.from_config(
            generation, [server.base_url], refit_dir=tmp_path / "refit"
        ) as engine:
            prompt = [1, 504, 3458, 282, 4649, 314]
            [sampled] = engine.generate([_request(prompt, 16, temperature=0.7, top_p=0.9)])
            assert len(sampled.token_ids) == len(sampled.logprobs) >= 1
            model = load_pretrained(checkpoint, torch.float32).cuda().eval()
            ids = torch.tensor([prompt + sampled.token_ids], device="cuda")
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / 0.7
            expected = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :].unsqueeze(-1))
            got = torch.tensor(sampled.logprobs, device="cuda")
            assert (expected.squeeze(-1) - got).abs().mean() < 0.05  # bf16 server vs fp32 HF

            [greedy_before] = engine.generate([_request(prompt, 8, temperature=0.0)])
            engine.refit_from_disk(checkpoint, 1)
            [greedy_after] = engine.generate([_request(prompt, 8, temperature=0.0)])
            assert engine.weight_version == 1 and greedy_after.weight_version == 1
            assert greedy_after.token_ids == greedy_before.token_ids
            engine.update_weights(model.state_dict(), 2)
            [greedy_pushed] = engine.generate([_request(prompt, 8, temperature=0.0)])
            assert greedy_pushed.weight_version == 2
            assert greedy_pushed.token_ids == greedy_before.token_ids


@pytest.mark.gpu
def test_real_sglang_server_group_on_ray(tmp_path):
    checkpoint = _real_sglang_checkpoint()
    import ray
    from ray.util.placement_group import placement_group

    from gymrl.cluster.placement import RolePlacement
    from gymrl.generation.sglang.servers import SGLangServerGroup

    generation = SGLangGenerationConfig(num_engines=1, mem_fraction_static=0.3)
    policy = _policy(path=str(checkpoint), dtype="bfloat16", max_total_sequence_length=2048)
    ray.init(num_gpus=1, num_cpus=4, include_dashboard=False)
    try:
        bundles = placement_group([{"GPU": 1.0, "CPU": 1.0}])
        ray.get(bundles.ready(), timeout=120)
        group = SGLangServerGroup(
            generation,
            policy,
            model_path=str(checkpoint),
            seed=0,
            log_dir=tmp_path,
            placement_group=bundles,
            engines=RolePlacement(gpus_per_actor=1.0, cpus_per_actor=1.0, bundle_of_actor=(0,)),
        )
        with SGLangEngine.from_config(generation, group.urls) as engine:
            [out] = engine.generate([_request([1, 504, 3458], 8, temperature=1.0)])
        assert len(out.token_ids) == len(out.logprobs) >= 1
        group.shutdown()
    finally:
        ray.shutdown()


def test_loaded_refits_are_removed_except_the_live_one(tmp_path):
    refit_dir = tmp_path / "refit"
    for name in ("v1", "v2", "v3"):
        (refit_dir / name).mkdir(parents=True)
        (refit_dir / name / "model.safetensors").write_bytes(b"x")
    remove_loaded_refits(refit_dir, keep=refit_dir / "v3")
    assert [entry.name for entry in refit_dir.iterdir()] == ["v3"]
    remove_loaded_refits(tmp_path / "absent", keep=tmp_path / "absent" / "v1")  # no refit yet

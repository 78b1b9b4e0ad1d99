"""The flagship's SGLang path against the real SGLang 0.5.23 server, on this CPU.

One server (SmolLM2-135M-Instruct, float32) is started for the whole module by the project's own
launcher (`server_command` with a CPU `generation.launch`, `SGLangServerProcess`: `real_sglang`),
from the venv `make sglang-venv` builds (`SGLANG_VENV`, default `.venv-sglang`); a second one
only for the routing and killed-mid-refit test. Marker `sglang_cpu`, run by `.ci/run`
after `make sglang-venv`: `python -m pytest -m sglang_cpu`.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from pydantic import SecretStr

from gymrl.config.schema.generation import TorchGenerationConfig
from gymrl.generation.server.app import create_policy_server_app
from gymrl.generation.sglang.engine import SGLangEngine, SGLangError
from gymrl.generation.sglang.refit_checks.weights_checker import (
    WeightCheckUnavailableError,
    WeightsChecker,
)
from gymrl.generation.sglang.servers import SGLangServerProcess
from gymrl.generation.sglang.weight_sync import Backend, WeightSender, WeightSyncError
from gymrl.generation.torch.engine import TorchGenerationEngine
from gymrl.generation.types import GenerationRequest, SamplingParams
from gymrl.model.loading import load_pretrained
from gymrl.model.tokens import model_end_token_ids
from nemo_gym_ext.envs.registry import make_rows, start_builtin_environment
from nemo_gym_ext.http_server import serve_in_thread
from tests.support.real_sglang import VENV, cpu_generation, start_cpu_server
from tests.support.sglang_answers import differences, shape, unanswered
from tests.support.sglang_standin import make_standin

pytestmark = pytest.mark.sglang_cpu

CONTEXT = 2048
# float32 on both sides; SGLang's torch_native attention and the torch engine's differ in
# summation order only, which moves log-probabilities by about 1e-5 on this model.
LOGPROB_TOLERANCE = 1e-3


@dataclass
class RealServer:
    process: SGLangServerProcess
    folder: Path
    version: int = 0  # the weight version it holds; tests that refit keep it current

    @property
    def url(self) -> str:
        return self.process.base_url

    def engine(self, **kwargs) -> SGLangEngine:
        kwargs.setdefault("end_token_ids", model_end_token_ids(self.folder))
        return SGLangEngine(
            [self.url],
            request_timeout_s=120.0,
            refit_timeout_s=120.0,
            weight_version=self.version,
            **kwargs,
        )


def start_server(folder: Path, log_path: Path) -> SGLangServerProcess:
    if not (VENV / "bin" / "python").is_file():
        pytest.fail(f"no SGLang venv at {VENV}: run `make sglang-venv` (or set SGLANG_VENV)")
    return start_cpu_server(folder, log_path, context_length=CONTEXT)


@pytest.fixture(scope="module")
def real_server(smollm2_dir, tmp_path_factory) -> Iterator[RealServer]:
    server = start_server(smollm2_dir, tmp_path_factory.mktemp("sglang") / "server.log")
    try:
        yield RealServer(server, smollm2_dir)
    finally:
        server.stop()


def _chat(tokenizer, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    """Answered at length: greedy runs past 48 tokens."""
    return _chat(tokenizer, "Name three colours.")


def _greedy(prompt: list[int], max_new_tokens: int, **params) -> GenerationRequest:
    return GenerationRequest(
        prompt, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **params)
    )


# ------------------------------------------------------------------------------- engine client
def test_ids_and_logprobs_match_the_torch_engine_on_the_same_weights(real_server, prompt):
    with real_server.engine() as engine:
        [served] = engine.generate([_greedy(prompt, 12)])
    model = load_pretrained(real_server.folder, torch.float32)
    torch_engine = TorchGenerationEngine.from_config(
        model,
        TorchGenerationConfig(max_batch_size=1, prefix_cache_tokens=0, decode_path="transformers"),
        seed=0,
        compute_dtype="float32",
        eos_token_ids=model_end_token_ids(real_server.folder),
    )
    try:
        [local] = torch_engine.generate([_greedy(prompt, 12)])
    finally:
        torch_engine.close()
    assert served.prompt_token_ids == prompt
    assert served.token_ids == local.token_ids and len(served.token_ids) == 12
    gaps = [abs(a - b) for a, b in zip(served.logprobs, local.logprobs, strict=True)]
    assert max(gaps) < LOGPROB_TOLERANCE, gaps
    assert served.finish_reason == "length" and served.weight_version == real_server.version


def test_stop_ids_and_the_models_own_end(real_server, prompt, tokenizer):
    with real_server.engine() as engine:
        [free] = engine.generate([_greedy(prompt, 6)])
        stop = free.token_ids[3]
        [stopped] = engine.generate([_greedy(prompt, 6, stop_token_ids=(stop,))])
        # No stop ids: the server stops at generation_config.json's eos_token_id by itself
        # (greedy SmolLM2 answers this in 12 tokens, the last <|im_end|>).
        [ended] = engine.generate([_greedy(_chat(tokenizer, "What is 2+2?"), 48)])
    first = free.token_ids.index(stop)
    assert stopped.token_ids == free.token_ids[: first + 1] and stopped.finish_reason == "stop"
    assert model_end_token_ids(real_server.folder) == (2,)
    assert ended.finish_reason == "stop" and ended.token_ids[-1] == 2


def test_a_refit_aborts_and_resumes_a_request_to_the_same_tokens(real_server, prompt):
    """Pause with abort mode, a disk refit to the same weights under version+1, resume: the
    request is resubmitted with its tokens so far and ends as it would have."""
    with real_server.engine() as engine:
        [uninterrupted] = engine.generate([_greedy(prompt, 40)])
        future = engine.submit(_greedy(prompt, 40))
        time.sleep(1.0)  # some tokens decode before the pause
        version = real_server.version + 1
        engine.refit_from_disk(real_server.folder, version)
        real_server.version = version
        resumed = future.result(timeout=300)
        [after] = engine.generate([_greedy(prompt, 4)])
    assert resumed.token_ids == uninterrupted.token_ids
    assert resumed.logprobs == pytest.approx(uninterrupted.logprobs, abs=LOGPROB_TOLERANCE)
    assert resumed.weight_version == version - 1  # the oldest version that sampled tokens
    assert after.weight_version == engine.weight_version == version  # meta_info agreed


def test_a_prompt_over_the_context_is_refused_by_the_server(real_server):
    with real_server.engine() as engine, pytest.raises(SGLangError) as refused:
        engine.generate([_greedy([100] * (CONTEXT + 10), 4)])
    message = str(refused.value)
    assert "POST /generate answered 400" in message and "context length" in message


# ------------------------------------------------------------------------------ broadcast refit
def _perturbed(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        name: tensor + 0.05 * torch.randn(tensor.shape, generator=generator)
        if "mlp.down_proj" in name
        else tensor
        for name, tensor in weights.items()
    }


def _sender(url: str, backend: Backend = "gloo") -> WeightSender:
    refit = cpu_generation().refit
    return WeightSender(
        [url],
        [1],
        master_address="127.0.0.1",
        backend=backend,
        bucket_bytes=refit.bucket_bytes,
        timeout_s=refit.timeout_s,
    )


def _broadcast(engine: SGLangEngine, sender: WeightSender, weights, version: int) -> None:
    engine.begin_refit(version)
    sender.send(weights.items(), version)
    engine.end_refit(version)


def test_a_broadcast_refit_over_gloo_changes_the_weights_and_brings_them_back(real_server, prompt):
    """nccl fails at once on a CPU and leaves nothing behind; then two gloo refits, each its
    own group (fresh name, destroyed on close), in flattened buckets."""
    weights = load_pretrained(real_server.folder, torch.float32).state_dict()
    with real_server.engine() as engine:
        [before] = engine.generate([_greedy(prompt, 12)])
        nccl = _sender(real_server.url, backend="nccl")
        start = time.monotonic()
        engine.begin_refit(real_server.version + 1)
        with pytest.raises(WeightSyncError):
            nccl.send(weights.items(), real_server.version + 1)
        assert time.monotonic() - start < 30
        nccl.close()
        changed_version = real_server.version + 1
        sender = _sender(real_server.url)
        try:
            sender.send(_perturbed(weights).items(), changed_version)
            engine.end_refit(changed_version)
            real_server.version = changed_version
            groups = [sender.group_name]
            assert sender.broadcasts >= 8  # 538 MB in 64 MiB buckets
        finally:
            sender.close()
        [changed] = engine.generate([_greedy(prompt, 12)])
        sender = _sender(real_server.url)
        try:
            _broadcast(engine, sender, weights, changed_version + 1)
            real_server.version = changed_version + 1
            groups.append(sender.group_name)
        finally:
            sender.close()
        [back] = engine.generate([_greedy(prompt, 12)])
    assert changed.token_ids != before.token_ids and changed.weight_version == changed_version
    assert back.token_ids == before.token_ids
    assert back.logprobs == pytest.approx(before.logprobs, abs=LOGPROB_TOLERANCE)
    assert groups[0] != groups[1]
    with httpx.Client(timeout=30.0) as client:  # close() destroyed the group on the server
        gone = client.post(
            f"{real_server.url}/destroy_weights_update_group", json={"group_name": groups[1]}
        )
    assert gone.status_code == 400


# A one-tensor distributed update naming a group that was never formed: the server must refuse
# it outside a weight-update session without joining any broadcast.
UPDATE_OUTSIDE_A_SESSION = {
    "names": ["model.norm.weight"],
    "dtypes": ["float32"],
    "shapes": [[576]],
    "group_name": "never-formed",
    "load_format": "flattened_bucket",
    "flush_cache": False,
}


def test_sessions_are_enforced_by_the_server_with_its_own_messages(real_server):
    """An update outside a session is refused (400) at once and joins no broadcast; an end
    without a begin is refused too."""
    update = UPDATE_OUTSIDE_A_SESSION
    with httpx.Client(timeout=30.0) as client:
        start = time.monotonic()
        outside = client.post(f"{real_server.url}/update_weights_from_distributed", json=update)
        assert time.monotonic() - start < 30
        end = client.post(f"{real_server.url}/end_weight_update", json={})
    assert outside.status_code == 400
    assert "must run between begin_weight_update() and end_weight_update()" in outside.text
    assert end.status_code == 400 and "no weight-update session is open" in end.text


# ---------------------------------------------------------------------------- weights checker
def test_the_weights_checker_actions_and_a_compare_that_cannot_run_here(real_server, prompt):
    """snapshot, reset_tensors and checksum run on a CPU; compare cannot (SGLang 0.5.23 moves
    tensors to CUDA in `utils/weight_checker_comparator.py`): the engine finds that out before
    any tensor is randomised and the server serves on."""
    url = f"{real_server.url}/weights_checker"
    checker = WeightsChecker(every=0, timeout_s=120.0)
    with real_server.engine(weights_checker=checker) as engine:
        [before] = engine.generate([_greedy(prompt, 8)])
        with pytest.raises(WeightCheckUnavailableError) as unavailable:
            engine.begin_refit(real_server.version)  # resends the held weights: snapshot path
        [served] = engine.generate([_greedy(prompt, 8)])  # not paused, not randomised
    assert served.token_ids == before.token_ids
    message = str(unavailable.value)
    assert "the weight check cannot run there" in message and "NVIDIA" in message
    with httpx.Client(timeout=120.0) as client:
        first = client.post(url, json={"action": "checksum"}).json()
        assert client.post(url, json={"action": "reset_tensors"}).status_code == 200
        randomised = client.post(url, json={"action": "checksum"}).json()
    assert first["success"] and len(first["per_engine_checksum"]) > 0
    assert randomised["per_engine_checksum"] != first["per_engine_checksum"]
    version = real_server.version + 1
    with real_server.engine() as engine:
        engine.refit_from_disk(real_server.folder, version)  # the weights come back from disk
        real_server.version = version
        [restored] = engine.generate([_greedy(prompt, 8)])
    with httpx.Client(timeout=120.0) as client:
        again = client.post(url, json={"action": "checksum"}).json()
    assert again["per_engine_checksum"] == first["per_engine_checksum"]
    assert restored.token_ids == before.token_ids and restored.weight_version == version


# ------------------------------------------------------------------------ stand-in vs real
def test_the_differences_found_are_status_keys_and_types():
    """The comparison itself: a missing key, another type (int against float too) and a key
    the client reads that only the real server answers are all reported."""
    real = {"meta_info": {"completion_tokens": 3, "weight_version": "0", "finish_reason": {}}}
    standin = {"meta_info": {"completion_tokens": 3.0, "extra": 1}}
    found = differences(shape(standin), shape(real))
    assert found == [
        ".meta_info.completion_tokens: stand-in float, real int",
        ".meta_info.extra: only the stand-in answers it",
    ]
    assert unanswered("/generate", standin, real) == [
        "/generate: meta_info.weight_version answered by the real server only"
    ]


def test_the_standin_answers_what_the_real_server_answers(real_server, prompt):
    """The same requests to the stand-in the CPU tests use and to the real server: each status
    must agree, every key the stand-in answers must be in the real answer with its type, and
    every key the client reads that the real server answers must be in the stand-in's."""
    norm = load_pretrained(real_server.folder, torch.float32).state_dict()["model.norm.weight"]
    app, _ = make_standin(context_length=CONTEXT, model_weights={"model.norm.weight": norm})
    generate = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 3, "temperature": 0.0, "stop_token_ids": [2]},
        "return_logprob": True,
        "logprob_start_len": -1,
    }
    update = UPDATE_OUTSIDE_A_SESSION
    calls = [
        ("/generate", generate),
        ("/generate", generate | {"input_ids": [100] * (CONTEXT + 1)}),
        ("/pause_generation", {"mode": "abort"}),
        ("/continue_generation", {}),
        ("/flush_cache", None),
        ("/begin_weight_update", {}),
        ("/begin_weight_update", {}),  # a session is open: refused
        ("/end_weight_update", {}),
        ("/end_weight_update", {}),  # none is open: refused
        ("/update_weights_from_distributed", update),
        ("/destroy_weights_update_group", {"group_name": "never-formed"}),
        ("/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 2}),
        ("/weights_checker", {"action": "checksum"}),
    ]
    found = []
    with serve_in_thread(app) as standin, httpx.Client(timeout=120.0) as client:
        for route, body in calls:
            answers = [
                client.post(f"{url}{route}", json=body) for url in (standin.url, real_server.url)
            ]
            ours, theirs = answers
            if ours.status_code != theirs.status_code:
                found.append(f"{route}: status {ours.status_code} here, {theirs.status_code} real")
                continue
            if ours.headers.get("content-type", "").startswith("application/json"):
                found += [
                    f"{route}{where}"
                    for where in differences(shape(ours.json()), shape(theirs.json()))
                ]
                found += unanswered(route, ours.json(), theirs.json())
    assert found == []


# ----------------------------------------------------------------------------- policy server
def test_the_policy_server_in_front_of_the_real_server_serves_an_agents_episode(
    real_server, chat_format
):
    """NeMo-Gym's built-in calculator agent, its resources server, the policy server (OpenAI
    API, token bundle) and the real SGLang server, all over loopback HTTP."""
    key = "sglang-cpu-test-key"
    with real_server.engine() as engine:
        app = create_policy_server_app(
            engine,
            chat_format,
            model_name="policy",
            api_key=SecretStr(key),
            honor_prompt_token_ids=True,
            default_max_tokens=24,
            max_context_tokens=CONTEXT,
            request_timeout_s=300.0,
            request_bytes_per_context_token=1024,
            render_timeout_s=60.0,
        )
        with (
            serve_in_thread(app) as policy,
            start_builtin_environment(
                "calculator",
                policy_base_url=f"{policy.url}/v1",
                policy_api_key=key,
                options={"max_turns": 2, "max_tokens": 24, "continue_after_length": True},
            ) as environment,
        ):
            row = make_rows("calculator", 1, seed=0)[0]
            response = httpx.post(f"{environment.agent_url}/run", json=row, timeout=600.0)
    assert response.status_code == 200, response.text
    result = response.json()
    turns = [item for item in result["response"]["output"] if "generation_token_ids" in item]
    assert turns, result["response"]["output"]
    for turn in turns:
        assert len(turn["generation_token_ids"]) == len(turn["generation_log_probs"]) > 0
        assert all(logprob <= 0 for logprob in turn["generation_log_probs"])
        assert turn["prompt_token_ids"]
    assert "reward" in result


# ------------------------------------------------------------------------- two real servers
def test_routing_over_two_servers_and_one_killed_mid_refit(real_server, prompt, tmp_path):
    second = start_server(real_server.folder, tmp_path / "second.log")
    try:
        urls = [real_server.url, second.base_url]
        prompts = [prompt, [*prompt[:-3], 504, 3458, *prompt[-3:]]]
        with SGLangEngine(
            urls,
            request_timeout_s=120.0,
            refit_timeout_s=120.0,
            weight_version=real_server.version,
            routing="least_loaded",
        ) as engine:
            # At version 0 the second server agrees with the first only if the first is too.
            if real_server.version != 0:
                engine.refit_from_disk(real_server.folder, real_server.version)
            outputs = engine.generate([_greedy(p, 4) for p in prompts * 2])
            assert all(len(out.token_ids) == 4 for out in outputs)
            # least_loaded spread the batch over both servers
            assert _generate_calls(tmp_path / "second.log") >= 1

            weights = load_pretrained(real_server.folder, torch.float32).state_dict()
            version = real_server.version + 1
            sender = WeightSender(
                urls,
                [1, 1],
                master_address="127.0.0.1",
                backend="gloo",
                bucket_bytes=16 << 20,
                timeout_s=30.0,
            )
            engine.begin_refit(version)
            killer = threading.Timer(1.0, os.killpg, (second.pid, signal.SIGKILL))
            killer.start()
            start = time.monotonic()
            try:
                with pytest.raises(WeightSyncError) as failed:
                    sender.send(weights.items(), version)
            finally:
                killer.join()
                sender.close()
            assert time.monotonic() - start < 90
            # Wherever the failure surfaced (the dead server's call, or the live server's half
            # of a broadcast that lost its peer), the error names the server that is gone.
            assert f"no longer answer GET /get_model_info: {second.base_url}" in str(failed.value)
    finally:
        second.stop()
    # The first server's session was closed and its group destroyed: it takes the next refit
    # (which also resumes its generation, paused since the failed one).
    with real_server.engine() as engine:
        engine.refit_from_disk(real_server.folder, real_server.version + 2)
        real_server.version += 2
        [out] = engine.generate([_greedy(prompt, 4)])
    assert out.weight_version == real_server.version


def _generate_calls(log: Path) -> int:
    return log.read_text(errors="replace").count('"POST /generate HTTP/1.1" 200')

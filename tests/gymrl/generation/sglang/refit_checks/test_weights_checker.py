"""The weights checker method against stand-in SGLang servers: snapshot, reset and compare
around the first refit of a fresh run, checksums agreeing across servers after a later one, by
broadcast and from disk."""

from __future__ import annotations

import pytest
import torch
from fastapi import Request
from fastapi.responses import JSONResponse

from gymrl.config.schema.generation import RefitConfig, SGLangGenerationConfig
from gymrl.generation.sglang.engine import SGLangEngine
from gymrl.generation.sglang.refit import weight_sender
from gymrl.generation.sglang.refit_checks.read_back import WeightMismatchError
from gymrl.generation.sglang.refit_checks.weights_checker import (
    ROUTE,
    WeightCheckUnavailableError,
    WeightsChecker,
    checker_for,
)
from gymrl.generation.sglang.weight_sync import WeightSender
from gymrl.generation.types import GenerationRequest, SamplingParams
from nemo_gym_ext.http_server import serve_in_thread
from tests.support.sglang_standin import make_standin

RENAMED = "model.layers.0.self_attn.qkv_proj.weight"  # what the server's model calls q_proj
# The first refit: snapshot, a compare proving it can run, snapshot, randomise, refit, compare.
FIRST_REFIT = ["snapshot", "compare", "snapshot", "reset_tensors", "compare"]
# What SGLang 0.5.23's compare answers on a CPU (a `.cuda()` in weight_checker_comparator.py).
NO_CUDA = "Found no NVIDIA driver on your system."


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(32, 8, generator=generator),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=generator),
        "model.layers.0.input_layernorm.weight": torch.randn(8, generator=generator).bfloat16(),
        "model.norm.weight": torch.randn(8, generator=generator),
    }


def _renamed(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` as a model that knows q_proj under another name holds them."""
    model = {name: tensor.clone() for name, tensor in weights.items()}
    model[RENAMED] = model.pop("model.layers.0.self_attn.q_proj.weight")
    return model


def _engine(urls, tmp_path, **check) -> SGLangEngine:
    checker = WeightsChecker(**({"every": 0, "timeout_s": 10.0} | check))
    return SGLangEngine(
        urls,
        request_timeout_s=10.0,
        refit_timeout_s=10.0,
        refit_dir=tmp_path / "refit",
        weights_checker=checker,
    )


def _sender(urls) -> WeightSender:
    return WeightSender(
        urls,
        [1] * len(urls),
        master_address="127.0.0.1",
        backend="gloo",
        bucket_bytes=1024,
        timeout_s=20.0,
    )


def _broadcast(engine: SGLangEngine, sender: WeightSender, weights, version: int) -> None:
    engine.begin_refit(version)
    sender.send(weights.items(), version)
    engine.end_refit(version)


def _refit(transport: str, engine, urls, weights, version: int) -> None:
    """One refit to `version` by broadcast or from disk (`SGLangEngine.update_weights`)."""
    if transport == "disk":
        engine.update_weights(weights, version)
        return
    sender = _sender(urls)
    try:
        _broadcast(engine, sender, weights, version)
    finally:
        sender.close()


def _request() -> GenerationRequest:
    return GenerationRequest([1, 2, 3], SamplingParams(max_new_tokens=4, temperature=0.0))


def _actions(state) -> list[str]:
    return [action for kind, action in state.events if kind == "weights_checker"]


@pytest.mark.parametrize("transport", ["nccl", "disk"])
def test_the_first_refit_is_compared_with_the_weights_the_servers_started_with(
    standins, tmp_path, transport
):
    weights = _weights()
    servers = standins(2, model_weights=weights)
    urls = [url for url, _ in servers]
    with _engine(urls, tmp_path) as engine:
        _refit(transport, engine, urls, weights, 0)
        assert engine.weight_version == 0
    for _, state in servers:
        assert _actions(state) == FIRST_REFIT
        # The refit wrote every tensor back over the random ones, and generation resumed.
        assert all(torch.equal(state.weights[n], t) for n, t in weights.items())
        assert state.snapshot is None and not state.paused


@pytest.mark.parametrize("transport", ["nccl", "disk"])
def test_a_tensor_the_refit_did_not_write_stops_the_run_naming_server_and_tensor(
    standins, tmp_path, transport
):
    weights = _weights()
    [(url, state)] = standins(1, model_weights=_renamed(weights))
    with _engine([url], tmp_path) as engine:
        with pytest.raises(WeightMismatchError) as raised:
            _refit(transport, engine, [url], weights, 0)
        assert engine.weight_version == 0
    message = str(raised.value)
    assert f"SGLang server {url} does not hold the weights it started with after refit 0" in message
    assert "check tensor equality failed:\nname=model.layers.0.self_attn.qkv_proj.weight" in message
    assert "max_abs_err=" in message and message.count("name=") == 1  # the others were written
    assert state.skipped == ["model.layers.0.self_attn.q_proj.weight"]  # and it said success
    assert state.paused  # generation never resumed on the half-random weights


def test_a_tensor_listed_in_verify_skip_tensors_is_left_out_of_the_check(standins, tmp_path):
    weights = _weights()
    [(url, state)] = standins(1, model_weights=_renamed(weights))
    with _engine([url], tmp_path, skip_tensors=("qkv_proj",)) as engine:
        _refit("nccl", engine, [url], weights, 0)
    assert _actions(state) == FIRST_REFIT
    assert torch.equal(state.weights[RENAMED], weights["model.layers.0.self_attn.q_proj.weight"])


def test_a_server_that_missed_a_later_refit_is_caught_by_the_checksums(standins, tmp_path):
    (url, state), (missed_url, missed) = standins(2, model_weights=_weights())
    with _engine([url, missed_url], tmp_path, every=1) as engine:
        _refit("nccl", engine, [url, missed_url], _weights(), 0)
        _refit("nccl", engine, [url, missed_url], _weights(seed=1), 1)  # checksums agree
        sender = _sender([url])  # the update reaches one server only
        try:
            with pytest.raises(WeightMismatchError) as raised:
                _broadcast(engine, sender, _weights(seed=2), 2)
        finally:
            sender.close()
        assert engine.weight_version == 1
    expected = [*FIRST_REFIT, "checksum", "checksum"]
    assert _actions(state) == _actions(missed) == expected
    message = str(raised.value)
    assert message.startswith("the SGLang servers hold different weights after refit 2")
    groups = message.split("per_engine_checksum ")[1].split(". A server")[0].split("; ")
    assert sorted(group.split(" on ")[1] for group in groups) == sorted([url, missed_url])
    assert all(len(group.split(" on ")[0]) == 64 for group in groups)  # each server's checksum


def test_a_resumed_runs_first_refit_is_checked_by_checksums_only(standins, tmp_path):
    """It sends a checkpoint's weights, which the servers never held: nothing to snapshot."""
    servers = standins(2, model_weights=_weights())
    urls = [url for url, _ in servers]
    with _engine(urls, tmp_path) as engine:
        _refit("nccl", engine, urls, _weights(seed=3), 40)  # every=0: the first refit only
        _refit("nccl", engine, urls, _weights(seed=4), 41)
    assert [_actions(state) for _, state in servers] == [["checksum"], ["checksum"]]


def test_one_engine_has_no_checksum_to_compare_with(standins, tmp_path):
    [(url, state)] = standins(1, model_weights=_weights())
    with _engine([url], tmp_path, every=1) as engine:
        _refit("disk", engine, [url], _weights(seed=1), 1)
    assert _actions(state) == []


def test_a_server_without_the_weights_checker_stops_the_run_naming_the_switch(tmp_path):
    """An SGLang build without `/weights_checker` answers 404: the check cannot run."""
    app, _ = make_standin(model_weights=_weights())
    app.router.routes = [r for r in app.router.routes if getattr(r, "path", "") != ROUTE]
    server = serve_in_thread(app)
    try:
        with (
            _engine([server.url], tmp_path) as engine,
            pytest.raises(WeightMismatchError) as raised,
        ):
            engine.begin_refit(0)
    finally:
        server.close()
    assert str(raised.value) == (
        f"SGLang server {server.url}: the weight check could not run (POST /weights_checker "
        """snapshot answered 404: '{"detail":"Not Found"}'); set """
        "generation.refit.verify_weights=false to run unchecked"
    )


def test_a_compare_that_cannot_run_is_no_mismatch_and_the_server_serves_on(tmp_path):
    """Only "check tensor equality failed:" is a mismatch. A compare that cannot run (as on a
    CPU) is found before any tensor is randomised: the refit never begins, generation goes on
    and the engine's refit count is what it was."""
    weights = _weights()
    app, state = make_standin(model_weights=weights)

    @app.middleware("http")
    async def compare_needs_cuda(request: Request, call_next):
        if request.url.path == ROUTE and (await request.json())["action"] == "compare":
            state.events.append(("weights_checker", "compare"))
            return JSONResponse({"success": False, "message": NO_CUDA}, status_code=400)
        return await call_next(request)

    server = serve_in_thread(app)
    try:
        with _engine([server.url], tmp_path) as engine:
            with pytest.raises(WeightCheckUnavailableError) as raised:
                engine.begin_refit(0)
            assert not state.paused and _actions(state) == ["snapshot", "compare"]
            assert all(torch.equal(state.weights[n], t) for n, t in weights.items())
            [out] = engine.generate([_request()])  # served, not taken for a refit's abort
            assert out.finish_reason == "length" and out.weight_version == 0
    finally:
        server.close()
    message = str(raised.value)
    assert f"SGLang server {server.url}: the weight check cannot run there" in message
    assert NO_CUDA in message and "verify_method=read_back" in message
    assert "does not hold the weights" not in message


def test_a_compare_failing_after_the_refit_for_another_reason_is_no_mismatch(tmp_path):
    weights = _weights()
    app, _ = make_standin(model_weights=weights)
    compares = []

    @app.middleware("http")
    async def second_compare_fails(request: Request, call_next):
        if request.url.path == ROUTE and (await request.json())["action"] == "compare":
            compares.append(1)
            if len(compares) == 2:
                return JSONResponse({"success": False, "message": NO_CUDA}, status_code=400)
        return await call_next(request)

    server = serve_in_thread(app)
    try:
        with (
            _engine([server.url], tmp_path) as engine,
            pytest.raises(WeightMismatchError) as raised,
        ):
            _refit("disk", engine, [server.url], weights, 0)
    finally:
        server.close()
    message = str(raised.value)
    assert "the weight check could not run" in message and NO_CUDA in message
    assert "its tensors may be partly random now: stopping the run" in message


def test_the_config_picks_the_method():
    assert RefitConfig().verify_weights and RefitConfig().verify_method == "weights_checker"
    refit = RefitConfig.model_validate(  # as Hydra hands it over: a list
        {"verify_every": 3, "timeout_s": 7.0, "verify_skip_tensors": ["x"]}
    )
    assert checker_for(refit) == WeightsChecker(every=3, timeout_s=7.0, skip_tensors=("x",))
    assert checker_for(RefitConfig(verify_weights=False)) is None
    assert checker_for(RefitConfig(verify_method="read_back")) is None


def test_an_engine_made_from_the_default_config_checks_its_first_refit(standins, tmp_path):
    weights = _weights()
    servers = standins(2, model_weights=weights)
    generation = SGLangGenerationConfig(num_engines=2)
    urls = [url for url, _ in servers]
    with SGLangEngine.from_config(generation, urls, refit_dir=tmp_path) as engine:
        engine.update_weights(weights, 0)  # the torch trainer's refit of SGLang: from disk
    assert [_actions(state) for _, state in servers] == [FIRST_REFIT] * 2


def test_only_read_back_makes_the_sender_read_weights_back(standins):
    weights = _weights()
    [(url, state)] = standins(1, model_weights=weights)
    for method in ("weights_checker", "read_back"):
        sender = weight_sender(
            [url],
            [1],
            RefitConfig(verify_method=method),
            master_address="127.0.0.1",
            backend="gloo",
            served_dtype="float32",
        )
        try:
            sender.send(weights.items(), 0)
        finally:
            sender.close()
    reads = [name for kind, name in state.events if kind == "get_weights"]
    assert len(reads) == 4  # the read_back sender's first refit only

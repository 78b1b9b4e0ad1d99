"""A LoRA run's adapter refits into SGLang servers (`gymrl.generation.sglang.adapters`,
`SGLangEngine.update_adapter`) against the stand-in server: the launch flags, the versioned
names, the requests naming the current version, the window of loaded versions, the rule for a
request in flight, and each failure named. The same against the real server on this CPU:
`test_real_server.py`."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from gymrl.config.schema.generation import SGLangGenerationConfig, SGLangLaunchConfig
from gymrl.config.schema.grpo import GRPOConfig
from gymrl.config.schema.policy import PolicyConfig
from gymrl.config.schema.trainer import LoraConfig
from gymrl.generation.sglang.adapters import (
    AdapterServing,
    adapter_name,
    check_adapter,
    versions_kept,
)
from gymrl.generation.sglang.engine import SGLangEngine, SGLangError
from gymrl.generation.sglang.servers import server_command
from gymrl.generation.types import GenerationRequest, SamplingParams
from gymrl.run.adapter import AdapterWeights

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _serving(kept: int = 2) -> AdapterServing:
    return AdapterServing(rank=4, target_modules=TARGETS, versions_kept=kept, backend="csgmv")


def _adapter(seed: int = 0, modules=("self_attn.q_proj", "mlp.down_proj"), rank=4):
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for module in modules:
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, 8, generator=generator)
            tensors[f"{key}.lora_B.weight"] = torch.randn(8, rank, generator=generator)
    config = {"r": rank, "lora_alpha": 2 * rank, "target_modules": {"q_proj", "down_proj"}}
    return AdapterWeights(config=config, tensors=tensors)


def _engine(urls, serving: AdapterServing | None = None, **kwargs) -> SGLangEngine:
    return SGLangEngine(
        urls, request_timeout_s=10.0, refit_timeout_s=10.0, adapters=serving or _serving(), **kwargs
    )


def _request(max_new_tokens: int = 3) -> GenerationRequest:
    return GenerationRequest([1, 2, 3], SamplingParams(max_new_tokens=max_new_tokens))


def _lora_paths(state) -> list[str | None]:
    return [body.get("lora_path") for path, body in state.requests if path == "/generate"]


# --------------------------------------------------------------------------- launch and config
def test_a_lora_runs_servers_start_with_its_adapter_flags_and_a_full_runs_without():
    grpo = GRPOConfig(num_steps=1, num_prompts_per_step=1, num_generations_per_prompt=2)
    launch = SGLangLaunchConfig(lora_backend="torch_native")
    assert AdapterServing.of(LoraConfig(), grpo, launch) is None
    serving = AdapterServing.of(LoraConfig(enabled=True, rank=8), grpo, launch)
    assert serving is not None and serving.versions_kept == 2  # max_trajectory_age_steps 1
    policy = PolicyConfig(name="m", source="pretrained", path="/m", max_total_sequence_length=64)
    generation = SGLangGenerationConfig(launch=launch)
    command = server_command(generation, policy, model_path="/m", port=1, seed=0, adapters=serving)
    assert "--enable-lora" in command and "--lora-strict-loading" in command
    assert command[command.index("--max-lora-rank") + 1] == "8"
    assert command[command.index("--lora-backend") + 1] == "torch_native"
    assert command[command.index("--max-loaded-loras") + 1] == "3"  # the window and the new one
    assert command[command.index("--max-loras-per-batch") + 1] == "3"
    start = command.index("--lora-target-modules") + 1
    assert tuple(command[start : start + len(TARGETS)]) == TARGETS
    plain = server_command(generation, policy, model_path="/m", port=1, seed=0)
    assert not any("lora" in flag for flag in plain)


def test_the_window_is_the_staleness_bound_plus_the_current_version():
    grpo = GRPOConfig(num_steps=1, num_prompts_per_step=1, num_generations_per_prompt=2)
    assert versions_kept(grpo.model_copy(update={"max_trajectory_age_steps": 3})) == 4
    assert versions_kept(grpo.model_copy(update={"async_enabled": False})) == 1


def test_an_adapter_the_servers_would_not_apply_is_refused_by_name():
    check_adapter(_adapter(), _serving(), 1)
    with pytest.raises(ValueError, match="rank 8; the SGLang servers hold adapters of rank"):
        check_adapter(_adapter(rank=8), _serving(), 1)
    with pytest.raises(ValueError, match=r"version 3: modules \['model.layers.0.attn.c_attn'"):
        check_adapter(_adapter(modules=("attn.c_attn", "mlp.down_proj")), _serving(), 3)
    lm_head = AdapterWeights(
        {"r": 4, "lora_alpha": 8},
        {
            "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 8),
            "base_model.model.lm_head.lora_B.weight": torch.zeros(8, 4),
        },
    )
    with pytest.raises(ValueError, match=r"\['lm_head'\] \(1 of 1\) match no decoder-layer"):
        check_adapter(lm_head, _serving(), 1)
    half_key = "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"
    half = AdapterWeights({"r": 4}, {half_key: torch.zeros(4, 8)})
    with pytest.raises(ValueError, match="lack lora_A or lora_B"):
        check_adapter(half, _serving(), 1)


# ------------------------------------------------------------------------------------ refits
def test_each_refit_loads_a_versioned_adapter_that_every_later_request_names(standin):
    servers = [standin(), standin()]
    with _engine([url for url, _ in servers]) as engine:
        [base] = engine.generate([_request()])
        engine.update_adapter(_adapter(1), 1)
        [first] = engine.generate([_request()])
        engine.update_adapter(_adapter(2), 2)
        [second] = engine.generate([_request()])
    assert (base.weight_version, first.weight_version, second.weight_version) == (0, 1, 2)
    assert engine.weight_version == 2
    for _, state in servers:
        assert set(state.adapters) == {"policy_v1", "policy_v2"}
        load = next(body for path, body in state.requests if path.startswith("/load_lora"))
        assert load["lora_name"] == "policy_v1" and load["config_dict"]["r"] == 4
        assert load["config_dict"]["target_modules"] == ["down_proj", "q_proj"]  # JSON, sorted
        assert len(load["expected_checksums"]) == 8  # checked by the server
        assert len(load["serialized_named_tensors"]) == 1  # one copy per TP rank
    paths = _lora_paths(servers[0][1]) + _lora_paths(servers[1][1])
    assert sorted(map(str, paths)) == ["None", "policy_v1", "policy_v2"]
    # The adapter loaded is the adapter sent, tensor for tensor.
    for key, tensor in _adapter(2).tensors.items():
        assert torch.equal(servers[0][1].adapters["policy_v2"][key], tensor)


def test_versions_older_than_the_window_are_unloaded_so_the_count_stays_bounded(standin):
    url, state = standin()
    serving = _serving(kept=2)
    with _engine([url], serving) as engine:
        for version in range(1, 8):  # more refits than --max-loaded-loras (3)
            engine.update_adapter(_adapter(version), version)
            assert len(state.adapters) <= serving.versions_kept
        [output] = engine.generate([_request()])
    assert set(state.adapters) == {"policy_v6", "policy_v7"}
    unloaded = [name for event, name in state.events if event == "unload_adapter"]
    assert unloaded == [adapter_name(version) for version in range(1, 6)]
    assert output.weight_version == 7 and _lora_paths(state)[-1] == "policy_v7"


def test_a_request_in_flight_keeps_the_version_it_was_sent_with(standin):
    """No pause and no abort: the request finishes under its own adapter and reports its
    version; a version past the window is unloaded only once its last request is done."""
    url, state = standin(token_delay_s=0.05)
    with _engine([url], _serving(kept=1)) as engine:
        engine.update_adapter(_adapter(1), 1)
        future = engine.submit(_request(max_new_tokens=20))  # about a second
        while not state.adapter_requests.get("policy_v1"):
            time.sleep(0.01)
        refit = threading.Thread(target=engine.update_adapter, args=(_adapter(2), 2))
        refit.start()
        deadline = time.monotonic() + 10
        while engine.weight_version != 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # v2 is served before v1 is unloaded
        [later] = engine.generate([_request(max_new_tokens=1)])
        assert not future.done()  # v1's request is still running: the unload waits for it
        early = future.result(timeout=30)
        refit.join(timeout=30)
    assert early.weight_version == 1 and len(early.token_ids) == 20
    assert later.weight_version == 2
    assert not any(event[0] in ("pause", "abort") for event in state.events)
    assert set(state.adapters) == {"policy_v2"}  # unloaded after its request finished


def test_a_load_the_server_refuses_or_does_not_list_fails_naming_server_and_version(standin):
    url, state = standin()
    with _engine([url]) as engine:
        engine.update_adapter(_adapter(1), 1)
        state.adapters["policy_v2"] = {}  # someone else loaded this name
        with pytest.raises(SGLangError, match=rf"{url}: loading adapter version 2 \(policy_v2\)"):
            engine.update_adapter(_adapter(2), 2)
        del state.adapters["policy_v2"]
        state.hide_adapters = True
        with pytest.raises(SGLangError, match=rf"{url} .* adapter version 3 .* not list policy_v3"):
            engine.update_adapter(_adapter(3), 3)
        state.hide_adapters = False
        assert engine.weight_version == 1  # requests go on naming the last version served
        engine.generate([_request()])
        with pytest.raises(ValueError, match="version 1 is not newer than the loaded version 1"):
            engine.update_adapter(_adapter(4), 1)
        with pytest.raises(ValueError, match="match no decoder-layer module"):
            engine.update_adapter(_adapter(5, modules=("attn.c_attn",)), 5)
    assert _lora_paths(state)[-1] == "policy_v1"


def test_an_engine_without_adapter_serving_refuses_an_adapter_refit(standin):
    url, _ = standin()
    engine = SGLangEngine([url], request_timeout_s=5.0, refit_timeout_s=5.0)
    with engine, pytest.raises(ValueError, match="servers started for adapters"):
        engine.update_adapter(_adapter(), 1)


def test_a_restarted_server_is_caught_by_the_adapter_it_lost(standin):
    """The base weights stay version 0 on every server in a LoRA run, so the weight-version
    check cannot see a restart; the adapter the restarted server lacks can: the request naming
    it is refused, naming the adapter."""
    url, state = standin()
    with _engine([url]) as engine:
        engine.update_adapter(_adapter(1), 1)
        state.adapters.clear()
        with pytest.raises(SGLangError, match="not loaded: policy_v1"):
            engine.generate([_request()])

"""A LoRA run's adapter refits into the real SGLang 0.5.23 server on this CPU (SmolLM2-135M,
float32, `--lora-backend torch_native` with the CPU stand-ins' unpinned buffers): the adapter
SGLang applies unmerged generates what the torch engine generates with the same adapter merged
into its weights, a zero B is the base model, and a long run of refits keeps the loaded count
within the window. Marker `sglang_cpu` (`make test-sglang`)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
import torch

from gymrl.config.schema.generation import TorchGenerationConfig
from gymrl.config.schema.trainer import LoraConfig
from gymrl.generation.sglang.adapters import AdapterServing, load_request
from gymrl.generation.sglang.engine import SGLangEngine
from gymrl.generation.sglang.servers import SGLangServerProcess
from gymrl.generation.torch.engine import TorchGenerationEngine
from gymrl.generation.types import GenerationOutput, GenerationRequest, SamplingParams
from gymrl.model.loading import load_pretrained
from gymrl.model.tokens import model_end_token_ids
from gymrl.run.adapter import AdapterWeights, attach_lora
from nemo_gym_ext.http_server import serve_in_thread
from tests.support.real_sglang import VENV, start_cpu_server
from tests.support.sglang_answers import differences, shape, unanswered
from tests.support.sglang_standin import make_standin

pytestmark = pytest.mark.sglang_cpu

LORA = LoraConfig(enabled=True, rank=8, alpha=16)
SERVING = AdapterServing(
    rank=LORA.rank, target_modules=LORA.target_modules, versions_kept=2, backend="torch_native"
)
# float32 on both sides; the torch_native LoRA kernels add x A^T B^T to the base output where the
# torch engine multiplies by the merged weight: summation order only.
LOGPROB_TOLERANCE = 1e-3
QUESTIONS = ("Name three colours.", "What is 2+2?", "Write a haiku about rain.")


@pytest.fixture(scope="module")
def lora_server(smollm2_dir, tmp_path_factory) -> Iterator[SGLangServerProcess]:
    if not (VENV / "bin" / "python").is_file():
        pytest.fail(f"no SGLang venv at {VENV}: run `make sglang-venv` (or set SGLANG_VENV)")
    log = tmp_path_factory.mktemp("sglang_lora") / "server.log"
    server = start_cpu_server(smollm2_dir, log, context_length=2048, adapters=SERVING)
    try:
        yield server
    finally:
        server.stop()


def _loaded(server: SGLangServerProcess) -> list[str]:
    """The adapters the server lists in /v1/models (beside the base model, which has no
    parent)."""
    models = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()["data"]
    return sorted(model["id"] for model in models if model.get("parent"))


@pytest.fixture
def server(lora_server) -> Iterator[SGLangServerProcess]:
    """The module's server, with every adapter a test loaded unloaded after it: each test's
    engine starts on a server holding none, as a run's does."""
    yield lora_server
    for name in _loaded(lora_server):
        unload = {"lora_name": name}
        httpx.post(f"{lora_server.base_url}/unload_lora_adapter", json=unload, timeout=60)


def _engine(server: SGLangServerProcess, folder) -> SGLangEngine:
    return SGLangEngine(
        [server.base_url],
        request_timeout_s=120.0,
        refit_timeout_s=120.0,
        end_token_ids=model_end_token_ids(folder),
        adapters=SERVING,
    )


def _adapter(folder, seed: int, b_std: float) -> AdapterWeights:
    """A PEFT adapter of LORA's shape on SmolLM2 with B drawn (std `b_std`; 0: PEFT's own zero
    B, the base model)."""
    torch.manual_seed(seed)
    model = attach_lora(load_pretrained(folder, torch.float32), LORA)
    if b_std:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0.0, b_std)
    return AdapterWeights.of(model)


def _prompts(tokenizer) -> list[list[int]]:
    prompts = []
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return prompts


def _greedy(prompts: list[list[int]]) -> list[GenerationRequest]:
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    return [GenerationRequest(prompt, params) for prompt in prompts]


def _merged_outputs(folder, adapter: AdapterWeights, prompts) -> list[GenerationOutput]:
    """What the torch engine generates with `adapter` merged into its weights."""
    engine = TorchGenerationEngine.from_config(
        load_pretrained(folder, torch.float32),
        TorchGenerationConfig(max_batch_size=1, prefix_cache_tokens=0, decode_path="transformers"),
        seed=0,
        compute_dtype="float32",
        eos_token_ids=model_end_token_ids(folder),
    )
    try:
        engine.update_adapter(adapter, 1)
        return [engine.generate([request])[0] for request in _greedy(prompts)]
    finally:
        engine.close()


def _assert_same(served: list[GenerationOutput], local: list[GenerationOutput]) -> None:
    for ours, theirs in zip(served, local, strict=True):
        assert ours.token_ids == theirs.token_ids
        gaps = [abs(a - b) for a, b in zip(ours.logprobs, theirs.logprobs, strict=True)]
        assert max(gaps) < LOGPROB_TOLERANCE, gaps


def test_the_servers_adapter_generates_what_the_torch_engine_merged_and_zero_b_is_the_base(
    server, smollm2_dir, tokenizer
):
    prompts = _prompts(tokenizer)
    trained = _adapter(smollm2_dir, seed=1, b_std=0.05)
    zero = _adapter(smollm2_dir, seed=2, b_std=0.0)
    with _engine(server, smollm2_dir) as engine:
        base = engine.generate(_greedy(prompts))
        engine.update_adapter(zero, 1)
        zero_b = engine.generate(_greedy(prompts))
        engine.update_adapter(trained, 2)
        adapted = engine.generate(_greedy(prompts))
    assert [o.weight_version for o in base + zero_b + adapted] == [0] * 3 + [1] * 3 + [2] * 3
    _assert_same(zero_b, base)
    assert any(a.token_ids != b.token_ids for a, b in zip(adapted, base, strict=True))
    _assert_same(adapted, _merged_outputs(smollm2_dir, trained, prompts))


def test_more_refits_than_the_bound_keep_the_loaded_count_within_the_window(
    server, smollm2_dir, tokenizer
):
    adapter = _adapter(smollm2_dir, seed=3, b_std=0.01)
    [prompt] = _prompts(tokenizer)[:1]
    counts = []
    with _engine(server, smollm2_dir) as engine:
        for version in range(10, 10 + 2 * SERVING.max_loaded + 1):
            engine.update_adapter(adapter, version)
            counts.append(_loaded(server))
        [output] = engine.generate(_greedy([prompt]))
    assert max(len(loaded) for loaded in counts) <= SERVING.versions_kept
    last = 10 + 2 * SERVING.max_loaded
    assert counts[-1] == [f"policy_v{last - 1}", f"policy_v{last}"]
    assert output.weight_version == last


def test_a_request_in_flight_finishes_under_its_version_while_refits_unload_it(
    server, smollm2_dir, tokenizer
):
    """The rule on the real server: a request sent under version 1 finishes under version 1
    (the same greedy tokens as before any refit) while versions 2 and 3 load, the second
    unloading version 1, which SGLang does once that request is done."""
    adapters = [_adapter(smollm2_dir, seed=seed, b_std=0.05) for seed in (5, 6, 7)]
    long = GenerationRequest(
        _prompts(tokenizer)[2], SamplingParams(max_new_tokens=96, temperature=0.0)
    )
    with _engine(server, smollm2_dir) as engine:
        engine.update_adapter(adapters[0], 1)
        [alone] = engine.generate([long])
        in_flight = engine.submit(long)
        time.sleep(1.0)  # admitted and decoding
        engine.update_adapter(adapters[1], 2)
        engine.update_adapter(adapters[2], 3)  # unloads version 1 once its request is done
        finished = in_flight.result(timeout=300)
    assert finished.weight_version == 1 and finished.token_ids == alone.token_ids
    assert _loaded(server) == ["policy_v2", "policy_v3"]


def test_the_standin_answers_the_adapter_routes_as_the_real_server(server, smollm2_dir, tokenizer):
    """The same adapter calls to the stand-in the default suite uses and to the real server:
    each status must agree, every key the stand-in answers must be in the real answer with its
    type, and every key the client reads that the real server answers must be in the
    stand-in's (a load, the same name again, requests naming it and a name never loaded, an
    unload, and an unload of a name not loaded)."""
    load = load_request(_adapter(smollm2_dir, seed=4, b_std=0.01), 1, 1)
    generate = {
        "input_ids": _prompts(tokenizer)[0],
        "sampling_params": {"max_new_tokens": 2, "temperature": 0.0},
        "return_logprob": True,
        "logprob_start_len": -1,
    }
    calls = [
        ("/load_lora_adapter_from_tensors", load),
        ("/load_lora_adapter_from_tensors", load),  # already loaded: refused
        ("/generate", generate | {"lora_path": "policy_v1"}),
        ("/generate", generate | {"lora_path": "policy_v9"}),  # never loaded: refused
        ("/unload_lora_adapter", {"lora_name": "policy_v1"}),
        ("/unload_lora_adapter", {"lora_name": "policy_v1"}),  # no longer loaded: refused
    ]
    app, _ = make_standin(context_length=2048)
    found = []
    with serve_in_thread(app) as standin, httpx.Client(timeout=120.0) as client:
        for route, body in calls:
            ours, theirs = (
                client.post(f"{url}{route}", json=body) for url in (standin.url, server.base_url)
            )
            if ours.status_code != theirs.status_code:
                found.append(f"{route}: status {ours.status_code} here, {theirs.status_code} real")
                continue
            found += [
                f"{route}{where}" for where in differences(shape(ours.json()), shape(theirs.json()))
            ]
            found += unanswered(route, ours.json(), theirs.json())
    assert found == []

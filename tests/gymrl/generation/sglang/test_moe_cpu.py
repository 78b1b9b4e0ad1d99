"""The tiny Qwen3-MoE (`policy=tiny_qwen3_moe`) served by the real SGLang 0.5.23 server on this
CPU, against transformers on the same files.

The server is started as `test_sglang_cpu.py`'s are (`real_sglang.start_cpu_server`), launched for
router replay (`--enable-return-routed-experts`), with the MoE path's CPU stand-ins
(`cpu_standins/sglang_server/sglang_moe_on_cpu.py`) on its PYTHONPATH. On a CPU without AMX SGLang
routes with `fused_topk_torch_native` (softmax in float32, top-k, renormalised) and runs the
experts with `moe_forward_native`, plain torch both. Marker `sglang_cpu`; the expert-parallel
server (two ranks, 60-130 s to start on two busy cores) is also `slow`.
"""

from __future__ import annotations

import base64
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from gymrl.config.schema.policy import TinyMoeConfig
from gymrl.generation.server.route_store import RouteStore, routes_from
from gymrl.generation.sglang.engine import SGLangEngine
from gymrl.generation.sglang.refit_checks.read_back import WeightMismatchError
from gymrl.generation.sglang.refit_checks.weights_checker import WeightsChecker
from gymrl.generation.sglang.servers import SGLangServerProcess
from gymrl.generation.types import GenerationRequest, RouteLayout, SamplingParams
from gymrl.model.loading import load_pretrained
from gymrl.model.tokens import model_end_token_ids
from tests.support.real_sglang import start_cpu_server

pytestmark = pytest.mark.sglang_cpu

CONTEXT = 2048
GREEDY_TOKENS = 12
# float32 on both sides, the same routing: SGLang's torch_native attention and its expert loop sum
# in another order than transformers, which moved log-probabilities by at most 1e-6 here.
LOGPROB_TOLERANCE = 1e-4
# Router probabilities closer than this at the k-th choice are a tie either engine may break
# either way (the tiny MoE's closest, over a 40-token prompt: 7e-8); no other expert may differ.
ROUTER_TIE = 1e-5
TINY = TinyMoeConfig()


@pytest.fixture(scope="module")
def reference(tiny_moe_dir):
    return load_pretrained(tiny_moe_dir, torch.float32).eval()


def _start(folder: Path, log: Path, **options) -> SGLangServerProcess:
    start = time.monotonic()
    server = start_cpu_server(folder, log, context_length=CONTEXT, routed_experts=True, **options)
    print(f"\nSGLang {options} healthy in {time.monotonic() - start:.1f} s")
    return server


@pytest.fixture(scope="module")
def moe_server(tiny_moe_dir, tmp_path_factory) -> Iterator[SGLangServerProcess]:
    """Launched for router replay, with the weight check's compare on this CPU."""
    log = tmp_path_factory.mktemp("sglang_moe") / "server.log"
    server = _start(tiny_moe_dir, log, weight_compare=True)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3? Answer briefly."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _teacher_forced(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' log-probability of each token after the first, and each position's router
    probabilities `[positions, layers, experts]`."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    logprobs = torch.log_softmax(out.logits[0].float(), -1)[:-1]
    taken = logprobs.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    routers = torch.stack([torch.softmax(r.float(), -1) for r in out.router_logits], 1)
    return taken, routers


def _generate(url: str, prompt: list[int], **fields) -> dict:
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0.0},
        "return_routed_experts": True,
    } | fields
    answer = httpx.post(f"{url}/generate", json=body, timeout=120.0)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _routes(answer: dict, rows: int) -> np.ndarray:
    """`meta_info.routed_experts`: base64 of little-endian int32, one row of `[layers, top_k]`
    global expert ids per token from `routed_experts_start_len` on, the last sampled token
    (never run through the model) excepted."""
    raw = np.frombuffer(base64.b64decode(answer["meta_info"]["routed_experts"]), "<i4")
    return raw.reshape(rows, TINY.num_layers, TINY.num_experts_per_tok)


def _route_differences(routes: np.ndarray, routers: torch.Tensor) -> list[str]:
    """Positions and layers whose experts are not transformers' top-k (as sets), but for ties
    (:data:`ROUTER_TIE`)."""
    k = TINY.num_experts_per_tok
    ordered = routers.sort(-1, descending=True)
    found = []
    for position, layer in np.ndindex(routes.shape[:2]):
        expected = set(ordered.indices[position, layer, :k].tolist())
        gap = float(ordered.values[position, layer, k - 1] - ordered.values[position, layer, k])
        got = set(routes[position, layer].tolist())
        if got != expected and gap >= ROUTER_TIE:
            found.append(f"position {position} layer {layer}: {sorted(got)} not {expected}")
    return found


def test_the_engine_generates_greedily_with_transformers_log_probabilities(
    moe_server, tiny_moe_dir, reference, prompt
):
    """The project's SGLang client against the MoE server: greedy ids are transformers' argmax
    and their log-probabilities transformers' within LOGPROB_TOLERANCE."""
    request = GenerationRequest(
        prompt, SamplingParams(max_new_tokens=GREEDY_TOKENS, temperature=0.0)
    )
    with SGLangEngine(
        [moe_server.base_url],
        request_timeout_s=120.0,
        refit_timeout_s=120.0,
        end_token_ids=model_end_token_ids(tiny_moe_dir),
    ) as engine:
        [served] = engine.generate([request])
    assert served.finish_reason == "length" and len(served.token_ids) == GREEDY_TOKENS
    taken, _ = _teacher_forced(reference, prompt + served.token_ids)
    expected = taken[len(prompt) - 1 :]
    torch.testing.assert_close(
        torch.tensor(served.logprobs), expected, rtol=0, atol=LOGPROB_TOLERANCE
    )
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + served.token_ids])).logits[0]
    greedy = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
    assert served.token_ids == greedy


def test_routed_experts_from_a_start_are_transformers_top_k(moe_server, reference, prompt):
    """Each token's experts from `routed_experts_start_len` on: the whole sequence (0), from the
    prompt's last token (`len(prompt) - 1`, where a next turn would start asking), and the same
    request again served from the prefix cache, whose tokens keep the routes they were computed
    with. Prompt log-probabilities come back with them."""
    url = moe_server.base_url
    whole = _generate(url, prompt, return_logprob=True, logprob_start_len=0)
    output = whole["output_ids"]
    sequence = prompt + output
    taken, routers = _teacher_forced(reference, sequence)
    rows = len(sequence) - 1
    assert whole["meta_info"]["cached_tokens"] == 0  # logprob_start_len 0 skips the cache
    assert _route_differences(_routes(whole, rows), routers[:rows]) == []
    prompt_logprobs = [lp for lp, _, _ in whole["meta_info"]["input_token_logprobs"][1:]]
    torch.testing.assert_close(
        torch.tensor(prompt_logprobs), taken[: len(prompt) - 1], rtol=0, atol=LOGPROB_TOLERANCE
    )

    start = len(prompt) - 1
    tail = _generate(url, prompt, routed_experts_start_len=start)
    assert tail["output_ids"] == output
    assert np.array_equal(_routes(tail, rows - start), _routes(whole, rows)[start:])

    cached = _generate(url, prompt, routed_experts_start_len=0)
    assert cached["meta_info"]["cached_tokens"] > 0
    assert np.array_equal(_routes(cached, rows), _routes(whole, rows))


@pytest.mark.slow
def test_expert_parallel_2_serves_what_one_rank_serves(
    moe_server, tiny_moe_dir, reference, prompt, tmp_path
):
    """`generation.expert_parallel_size=2` (tensor parallelism 2: SGLang runs the experts'
    parallelism inside the TP group): each rank holds 4 of the 8 experts, and sees every token;
    the all-reduce after each MoE layer adds the two halves. Greedy ids, log-probabilities and
    routes (global expert ids) are the one-rank server's."""
    two = _start(tiny_moe_dir, tmp_path / "ep2.log", tensor_parallel_size=2, expert_parallel_size=2)
    try:
        split = _generate(two.base_url, prompt, return_logprob=True, logprob_start_len=0)
    finally:
        two.stop()
    whole = _generate(moe_server.base_url, prompt, return_logprob=True, logprob_start_len=0)
    assert split["output_ids"] == whole["output_ids"]
    rows = len(prompt) + len(whole["output_ids"]) - 1
    _, routers = _teacher_forced(reference, prompt + whole["output_ids"])
    assert _route_differences(_routes(split, rows), routers[:rows]) == []
    for key in ("input_token_logprobs", "output_token_logprobs"):
        split_logprobs = [lp for lp, _, _ in split["meta_info"][key] if lp is not None]
        whole_logprobs = [lp for lp, _, _ in whole["meta_info"][key] if lp is not None]
        torch.testing.assert_close(
            torch.tensor(split_logprobs),
            torch.tensor(whole_logprobs),
            rtol=0,
            atol=LOGPROB_TOLERANCE,
        )


def _route_layout(folder: Path) -> RouteLayout:
    return RouteLayout.of_model_config(json.loads((folder / "config.json").read_text()))


def _route_engine(url: str, folder: Path) -> SGLangEngine:
    """The project's client of the MoE server, asking for routes (router replay)."""
    return SGLangEngine(
        [url],
        request_timeout_s=120.0,
        refit_timeout_s=120.0,
        end_token_ids=model_end_token_ids(folder),
        route_layout=_route_layout(folder),
    )


def test_each_turn_brings_only_the_routes_the_previous_turn_lacked(
    moe_server, tiny_moe_dir, reference, tokenizer, prompt
):
    """Two turns of one conversation through the client and the policy server's route store:
    the second asks from the first's last sampled token (`routes_from`), so no position crosses
    the wire twice; assembled, the episode has every position's routes but the last token's,
    and they are transformers' top-k."""
    store = RouteStore(_route_layout(tiny_moe_dir), max_bytes=1 << 20)
    with _route_engine(moe_server.base_url, tiny_moe_dir) as engine:
        first = GenerationRequest(prompt, SamplingParams(max_new_tokens=8, temperature=0.0), 0)
        [one] = engine.generate([first])
        seen = prompt + one.token_ids
        assert (one.routed_experts.start, one.routed_experts.end) == (0, len(seen) - 1)
        store.put(seen, one.routed_experts)
        follow_up = seen + tokenizer("\nuser\nAnd 4+4?\nassistant\n")["input_ids"]
        second = GenerationRequest(
            follow_up,
            SamplingParams(max_new_tokens=8, temperature=0.0),
            routes_from=routes_from(len(seen)),
        )
        [two] = engine.generate([second])
    episode = follow_up + two.token_ids
    assert (two.routed_experts.start, two.routed_experts.end) == (len(seen) - 1, len(episode) - 1)
    store.put(episode, two.routed_experts)
    assembled = store.assemble(episode, [len(seen), len(episode)])
    rows = assembled[: len(episode) - 1]
    assert (rows != store.layout.missing).all()  # every position but the last arrived
    assert store.counts().held_calls == 0  # each call's routes handed out once
    _, routers = _teacher_forced(reference, episode)
    assert _route_differences(rows, routers[: len(episode) - 1]) == []


def test_a_generation_resumed_after_a_refit_keeps_the_routes_of_its_first_part(
    moe_server, tiny_moe_dir, reference, prompt
):
    """A refit aborts a long generation; the client resumes it asking routes only from where
    the aborted part's stopped, so the answer's routes run unbroken from the request's start
    to its last token but one (the refit reloads the same weights: the routes are the ones
    transformers chooses throughout)."""
    sent: list[dict] = []
    with _route_engine(moe_server.base_url, tiny_moe_dir) as engine:
        post = engine._post

        async def spy(url, path, body, *args, **kwargs):
            if path == "/generate":
                sent.append(body)
            return await post(url, path, body, *args, **kwargs)

        engine._post = spy
        request = GenerationRequest(prompt, SamplingParams(max_new_tokens=400, temperature=0.0), 0)
        future = engine.submit(request)
        deadline = time.monotonic() + 60
        while not sent and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # some tokens in
        # The version the server holds: a refit that leaves it as the later tests find it.
        engine.refit_from_disk(tiny_moe_dir, engine.weight_version)
        output = future.result(timeout=300)
    starts = [body["routed_experts_start_len"] for body in sent]
    assert len(sent) >= 2, "the refit did not interrupt the generation; nothing was resumed"
    assert starts[0] == 0 and all(later > 0 for later in starts[1:])
    sequence = prompt + output.token_ids
    routes = output.routed_experts
    assert (routes.start, routes.end) == (0, len(sequence) - 1)
    _, routers = _teacher_forced(reference, sequence)
    assert _route_differences(routes.rows, routers[: len(sequence) - 1]) == []


def test_the_weight_check_finds_an_expert_a_refit_did_not_write(
    moe_server, tiny_moe_dir, prompt, tmp_path
):
    """The check the MoE refit from Megatron runs with (`generation.refit.verify_weights`,
    `weights_checker`), with its compare on this CPU: a refit of the server's own weights that
    lacks one expert's tensor leaves that expert random, and the compare stops the refit naming
    the experts' tensor of its layer. A complete refit then puts every weight back (this test
    runs last: it changes the server's weight version)."""
    missing = "model.layers.1.mlp.experts.5.up_proj.weight"
    partial = tmp_path / "partial"
    partial.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(tiny_moe_dir / name, partial / name)
    weights = load_file(str(tiny_moe_dir / "model.safetensors"))
    del weights[missing]
    save_file(weights, str(partial / "model.safetensors"))
    url = moe_server.base_url

    def engine(version: int, checker: WeightsChecker | None = None) -> SGLangEngine:
        return SGLangEngine(
            [url],
            request_timeout_s=120.0,
            refit_timeout_s=120.0,
            weight_version=version,
            weights_checker=checker,
        )

    request = GenerationRequest(prompt, SamplingParams(max_new_tokens=8, temperature=0.0))
    with engine(0) as plain:
        [before] = plain.generate([request])
    checked = engine(0, WeightsChecker(every=0, timeout_s=120.0))
    with checked, pytest.raises(WeightMismatchError) as mismatch:
        checked.refit_from_disk(partial, 0)  # the version it holds: snapshot, randomise, compare
    message = str(mismatch.value)
    assert "check tensor equality failed" in message, message
    assert "model.layers.1.mlp.experts.w13_weight" in message, message
    with engine(0) as restoring:
        restoring.refit_from_disk(tiny_moe_dir, 1)
        [after] = restoring.generate([request])
    assert after.token_ids == before.token_ids and after.weight_version == 1

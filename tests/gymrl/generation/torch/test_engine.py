"""TorchGenerationEngine on a tiny random Llama with the real SmolLM2 tokenizer.

The reference for every generated token is a plain teacher-forced forward pass of prompt + tokens
(no cache, no padding, no batching), so these tests fail if the cache, the masks, the position
ids, the batch compaction or the sampler go wrong.
"""

from __future__ import annotations

import copy
import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from gymrl.config.schema.generation import TorchGenerationConfig
from gymrl.generation.torch.engine import EngineClosedError, TorchGenerationEngine, sample_tokens
from gymrl.generation.types import (
    EngineFailedError,
    GenerationOutput,
    GenerationRequest,
    SamplingParams,
)
from gymrl.model.loading import build_tiny_llama, ensure_smollm2_checkpoint, load_tokenizer
from gymrl.model.precision import body_autocast

CACHE_DIR = Path("~/.cache/gym-grpo-recipes/models").expanduser()
TEXTS = [
    "Hello there!",
    "Summarise the plot of a long novel about whales, the sea, and obsession.",
    "2+2=",
    "Write one line of Python that reverses a list called items.",
    "ok",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ensure_smollm2_checkpoint(CACHE_DIR))


def tiny_llama(tokenizer, seed: int):
    return build_tiny_llama(
        tokenizer, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, seed=seed
    )


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_llama(tokenizer, seed=0)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(text) for text in TEXTS]


def make_engine(
    model, *, seed=0, compute_dtype="float32", eos_token_ids=(), **generation
) -> TorchGenerationEngine:
    """Batches of 3 through the model's own forward (the fused step is test_llama_decode.py's),
    unless `generation` (fields of `TorchGenerationConfig`) says otherwise."""
    config = TorchGenerationConfig(
        **({"max_batch_size": 3, "decode_path": "transformers"} | generation)
    )
    return TorchGenerationEngine.from_config(
        model, config, seed=seed, compute_dtype=compute_dtype, eos_token_ids=eos_token_ids
    )


def request(prompt, **params) -> GenerationRequest:
    return GenerationRequest(prompt, SamplingParams(**({"max_new_tokens": 6} | params)))


def teacher_forced_logits(model, output: GenerationOutput) -> torch.Tensor:
    """Logits predicting each generated token, from one forward pass over prompt + generation."""
    ids = torch.tensor([output.prompt_token_ids + output.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    start = len(output.prompt_token_ids) - 1
    return logits[start : start + len(output.token_ids)]


def reference_logprobs(model, output: GenerationOutput, temperature: float) -> torch.Tensor:
    logits = teacher_forced_logits(model, output) / (temperature or 1.0)
    tokens = torch.tensor(output.token_ids)
    return torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_teacher_forcing_across_a_refilled_batch(model, prompts, temperature):
    # Five prompts of different lengths through three slots, finishing at different steps: the
    # cache is compacted, trimmed and refilled along the way.
    engine = make_engine(model)
    requests = [
        request(prompt, temperature=temperature, max_new_tokens=3 + 2 * i, seed=i)
        for i, prompt in enumerate(prompts)
    ]
    outputs = engine.generate(requests)
    for req, output in zip(requests, outputs, strict=True):
        assert output.prompt_token_ids == list(req.prompt_token_ids)
        assert len(output.token_ids) == req.params.max_new_tokens
        assert output.finish_reason == "length"
        expected = reference_logprobs(model, output, temperature)
        torch.testing.assert_close(torch.tensor(output.logprobs), expected, atol=1e-4, rtol=0)


def test_mixed_precision_logprobs_are_the_trainers_recomputation(model, prompts):
    """`policy.compute_dtype=bfloat16`: the body under autocast, the output layer in float32, as
    the trainer computes them; only kernel rounding (cached decoding vs one pass) separates the
    two, so the importance ratio starts near 1."""
    owned = copy.deepcopy(model)
    engine = make_engine(owned, compute_dtype="bfloat16")
    # It decodes with its body's matmul weights rounded once, not by autocast on every step.
    assert owned.model.layers[0].mlp.up_proj.weight.dtype is torch.bfloat16
    outputs = engine.generate(
        [
            request(prompt, temperature=1.0, max_new_tokens=8, seed=i)
            for i, prompt in enumerate(prompts)
        ]
    )
    cpu = torch.device("cpu")
    for output in outputs:
        ids = torch.tensor([output.prompt_token_ids + output.token_ids])
        with torch.no_grad(), body_autocast(cpu, torch.bfloat16):
            hidden = model.base_model(input_ids=ids).last_hidden_state
        logits = model.lm_head(hidden.float())[0]
        start = len(output.prompt_token_ids) - 1
        predicting = logits[start : start + len(output.token_ids)]
        expected = torch.log_softmax(predicting, -1).gather(1, ids[0, start + 1 :, None])
        error = (torch.tensor(output.logprobs) - expected.squeeze(1)).abs()
        assert float(error.max()) < 0.05, error


def test_greedy_is_the_argmax_continuation_with_untempered_logprobs(model, prompts):
    outputs = make_engine(model).generate(
        [request(prompt, temperature=0.0, max_new_tokens=7) for prompt in prompts]
    )
    for output in outputs:
        logits = teacher_forced_logits(model, output)
        assert output.token_ids == logits.argmax(dim=-1).tolist()
        expected = reference_logprobs(model, output, temperature=1.0)
        torch.testing.assert_close(torch.tensor(output.logprobs), expected, atol=1e-4, rtol=0)


def test_tiny_top_p_samples_the_greedy_tokens(model, prompts):
    engine = make_engine(model)
    greedy = engine.generate([request(p, temperature=0.0) for p in prompts])
    nucleus = engine.generate([request(p, temperature=1.0, top_p=1e-6, seed=3) for p in prompts])
    for greedy_output, nucleus_output in zip(greedy, nucleus, strict=True):
        assert nucleus_output.token_ids == greedy_output.token_ids
        # The log-probability is taken before top-p truncation, so it is not 0.
        assert max(nucleus_output.logprobs) < -1.0


def test_a_seeded_request_samples_the_same_alone_and_in_a_mixed_batch(model, prompts):
    engine = make_engine(model, max_batch_size=4)
    probe = request(prompts[1], temperature=0.9, top_p=0.95, max_new_tokens=6, seed=1234)
    alone = engine.generate([probe])[0]
    others = [
        request(prompts[0], temperature=0.0),
        request(prompts[2], temperature=1.3, seed=7, max_new_tokens=3),
        request(prompts[3], temperature=1.0),
        request(prompts[4], temperature=0.5, top_p=0.5, seed=8, max_new_tokens=8),
    ]
    mixed = engine.generate([*others[:2], probe, *others[2:]])[2]
    assert mixed.token_ids == alone.token_ids
    torch.testing.assert_close(mixed.logprobs, alone.logprobs, atol=1e-5, rtol=0)
    reseeded = engine.generate([request(prompts[1], temperature=0.9, top_p=0.95, seed=99)])[0]
    assert reseeded.token_ids != alone.token_ids


def test_unseeded_requests_draw_from_the_engine_seed(model, prompts):
    unseeded = [request(prompts[0], max_new_tokens=4), request(prompts[0], max_new_tokens=4)]
    first = make_engine(model, seed=5).generate(unseeded)
    again = make_engine(model, seed=5).generate(unseeded)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert first[0].token_ids != first[1].token_ids


def test_stops_on_request_stop_tokens_and_engine_eos(model, prompts):
    seeded = {"temperature": 1.0, "seed": 11, "max_new_tokens": 8}
    free = make_engine(model).generate([request(prompts[1], **seeded)])[0]
    stop = free.token_ids[4]
    cut = free.token_ids.index(stop) + 1
    by_request = make_engine(model).generate(
        [request(prompts[1], stop_token_ids=(stop,), **seeded)]
    )[0]
    by_engine = make_engine(model, eos_token_ids=[stop]).generate([request(prompts[1], **seeded)])[
        0
    ]
    for output in (by_request, by_engine):
        assert output.finish_reason == "stop"
        assert output.token_ids == free.token_ids[:cut]
        assert output.logprobs == free.logprobs[:cut]
    assert free.finish_reason == "length"
    assert len(free.token_ids) == 8


def test_finished_rows_and_padding_cost_no_compute(model, prompts):
    # Count the tokens fed to the model: prefill sees each prompt token once (packed, no
    # padding), and decoding feeds each row exactly its sampled tokens but the last.
    fed: list[int] = []
    handle = model.base_model.register_forward_pre_hook(
        lambda _module, _args, kwargs: fed.append(kwargs["input_ids"].numel()), with_kwargs=True
    )
    try:
        requests = [
            request(p, max_new_tokens=2 + 5 * (i % 3), seed=i) for i, p in enumerate(prompts)
        ]
        outputs = make_engine(model).generate(requests)
    finally:
        handle.remove()
    prompt_tokens = sum(len(p) for p in prompts)
    decoded_tokens = sum(len(o.token_ids) - 1 for o in outputs)
    assert sum(fed) == prompt_tokens + decoded_tokens


def test_refit_changes_the_outputs_and_the_version(tokenizer, prompts):
    engine = make_engine(tiny_llama(tokenizer, seed=0))
    sampled = [request(prompts[3], temperature=1.0, seed=4, max_new_tokens=8)]
    before = engine.generate(sampled)[0]
    assert before.weight_version == 0
    new_model = tiny_llama(tokenizer, seed=1)
    engine.update_weights(new_model.state_dict(), version=2)
    after = engine.generate(sampled)[0]
    assert engine.weight_version == 2
    assert after.weight_version == 2
    assert after.token_ids != before.token_ids
    expected = reference_logprobs(new_model, after, temperature=1.0)
    torch.testing.assert_close(torch.tensor(after.logprobs), expected, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match=r"weight version 1 is older .* current version 2"):
        engine.update_weights(new_model.state_dict(), version=1)
    incomplete = new_model.state_dict()
    incomplete.pop("model.norm.weight")
    with pytest.raises(RuntimeError, match=r"model\.norm\.weight"):
        engine.update_weights(incomplete, version=3)
    assert engine.weight_version == 2


def test_weights_sent_in_the_engines_dtypes_load_to_the_same_engine(tokenizer, prompts):
    """A bfloat16 engine stores its body's Linear weights rounded; a refit sent in those dtypes
    (half the bytes) leaves the engine exactly as the float32 refit does."""
    trained = tiny_llama(tokenizer, seed=1).state_dict()
    from_float32 = make_engine(tiny_llama(tokenizer, seed=0), compute_dtype="bfloat16")
    from_engine_dtypes = make_engine(tiny_llama(tokenizer, seed=0), compute_dtype="bfloat16")
    dtypes = from_engine_dtypes.weight_dtypes()
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == torch.bfloat16
    assert dtypes["model.embed_tokens.weight"] == torch.float32
    assert dtypes["model.norm.weight"] == torch.float32
    sent = {name: tensor.to(dtypes[name]) for name, tensor in trained.items()}
    sent_bytes = sum(t.numel() * t.element_size() for t in sent.values())
    assert sent_bytes < sum(t.numel() * t.element_size() for t in trained.values())
    from_float32.update_weights(trained, version=1)
    from_engine_dtypes.update_weights(sent, version=1)
    assert from_float32.weight_dtypes() == dtypes
    sampled = [request(prompt, temperature=1.0, seed=5, max_new_tokens=8) for prompt in prompts]
    one, other = from_float32.generate(sampled), from_engine_dtypes.generate(sampled)
    assert [o.token_ids for o in one] == [o.token_ids for o in other]
    assert [o.logprobs for o in one] == [o.logprobs for o in other]
    for engine in (from_float32, from_engine_dtypes):
        engine.close()


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (
            GenerationRequest([], SamplingParams(max_new_tokens=4)),
            r"requests\[1\]\.prompt_token_ids",
        ),
        (GenerationRequest([1, 10**7], SamplingParams(max_new_tokens=4)), r"outside.*10000000"),
        (GenerationRequest([1], SamplingParams(max_new_tokens=0)), r"max_new_tokens.*got 0"),
        (GenerationRequest([1], SamplingParams(4, temperature=-0.5)), r"temperature.*got -0\.5"),
        (GenerationRequest([1], SamplingParams(4, top_p=0.0)), r"top_p must be in \(0, 1\], got 0"),
        (GenerationRequest([1], SamplingParams(4, top_p=1.5)), r"top_p.*got 1\.5"),
        (GenerationRequest([1], SamplingParams(4, seed=-1)), r"seed must be None or .*got -1"),
    ],
)
def test_invalid_requests_are_rejected_naming_the_field(model, bad, message):
    with pytest.raises(ValueError, match=message):
        make_engine(model).generate([request([1, 2]), bad])


def test_a_model_whose_input_layer_is_not_a_token_embedding_is_refused(tokenizer):
    """The engine reads the vocabulary size off the embedding to check prompt ids."""
    model = tiny_llama(tokenizer, seed=0)
    model.set_input_embeddings(torch.nn.Identity())
    with pytest.raises(ValueError, match=r"torch\.nn\.Embedding.*Identity"):
        make_engine(model)


def test_concurrent_calls_from_four_threads(model, prompts):
    engine = make_engine(model, max_batch_size=2)
    batches = [
        [
            request(p, seed=10 * t + i, max_new_tokens=2 + t)
            for i, p in enumerate(prompts[t : t + 3])
        ]
        for t in range(4)
    ]
    expected = [engine.generate(batch) for batch in batches]
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = [pool.submit(engine.generate, batch) for batch in batches]
        results = [future.result(timeout=60) for future in futures]
    for got, want in zip(results, expected, strict=True):
        assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_sampler_respects_top_p_and_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    logits = probs.log().expand(1000, 4)
    uniforms = (torch.arange(1000) + 0.5) / 1000
    ones = torch.ones(1000)
    tokens, logprobs = sample_tokens(logits, ones, ones, uniforms)
    assert torch.bincount(tokens, minlength=4).tolist() == [500, 300, 200, 0]
    torch.testing.assert_close(logprobs, probs.log()[tokens])
    nucleus, _ = sample_tokens(logits, ones, torch.full((1000,), 0.6), uniforms)
    assert torch.bincount(nucleus, minlength=4).tolist() == [625, 375, 0, 0]
    edge, _ = sample_tokens(logits[:1], ones[:1], ones[:1], torch.tensor([1.0 - 1e-9]))
    assert edge.item() == 2


# ----------------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_on_cuda_matches_teacher_forcing(tokenizer, prompts, dtype):
    """The torch path on a GPU (`cluster.gpus_per_node > 0`): the engine runs where its model
    is, and every sampled token's log-probability is the teacher-forced one on the same GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    model = build_tiny_llama(
        tokenizer,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        intermediate_size=128,
        seed=0,
        dtype=dtype,
    ).to("cuda")
    engine = make_engine(model, seed=3)
    outputs = engine.generate([request(p, temperature=0.7, seed=i) for i, p in enumerate(prompts)])
    for output in outputs:
        assert len(output.token_ids) == len(output.logprobs) == 6
        ids = torch.tensor([output.prompt_token_ids + output.token_ids], device="cuda")
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float()
        start = len(output.prompt_token_ids) - 1
        predicting = logits[start : start + len(output.token_ids)] / 0.7
        expected = torch.log_softmax(predicting, dim=-1).gather(1, ids[0, start + 1 :, None])
        error = (torch.tensor(output.logprobs) - expected.squeeze(1).cpu()).abs()
        if dtype == torch.float32:
            assert float(error.max()) < 1e-3
        else:  # bf16: cached, packed kernels vs one plain forward pass round differently
            assert float(error.mean()) < 0.05


class _ForwardLog:
    """The batch size of every forward pass the model's body runs (a prefill packs its prompts
    into one row, so it logs 1), with an event per pass so a test can wait for progress."""

    def __init__(self, model):
        self.sizes: list[int] = []
        self._passes = threading.Semaphore(0)
        self._handle = model.base_model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, _module, _args, kwargs):
        self.sizes.append(kwargs["input_ids"].shape[0])
        self._passes.release()

    def wait_passes(self, count: int) -> None:
        for _ in range(count):
            assert self._passes.acquire(timeout=30), "the engine made no progress"

    def close(self):
        self._handle.remove()


def test_a_request_joins_the_rows_already_decoding_and_is_answered_when_it_ends(model, prompts):
    engine = make_engine(model, max_batch_size=4)
    log = _ForwardLog(model)
    try:
        long = engine.submit(request(prompts[1], max_new_tokens=120, seed=1))
        log.wait_passes(3)  # its prefill and two decode steps
        short = engine.submit(request(prompts[2], max_new_tokens=3, seed=2))
        answer = short.result(timeout=60)
        assert not long.done(), "the short request waited for the long one"
        long_answer = long.result(timeout=60)
    finally:
        log.close()
        engine.close()
    assert len(answer.token_ids) == 3 and len(long_answer.token_ids) == 120
    assert 2 in log.sizes, "the short request never decoded alongside the long one"
    alone = make_engine(model).generate([request(prompts[2], max_new_tokens=3, seed=2)])[0]
    assert answer.token_ids == alone.token_ids
    torch.testing.assert_close(answer.logprobs, alone.logprobs, atol=1e-5, rtol=0)


def test_a_refit_waits_for_the_rows_in_flight_and_holds_back_new_ones(tokenizer, prompts):
    engine = make_engine(tiny_llama(tokenizer, seed=0), max_batch_size=4)
    log = _ForwardLog(engine._model)
    try:
        before = engine.submit(request(prompts[1], max_new_tokens=60, seed=1))
        log.wait_passes(2)
        refit = threading.Thread(
            target=engine.update_weights,
            args=(tiny_llama(tokenizer, seed=1).state_dict(), 1),
        )
        refit.start()
        while not engine._refits_waiting:  # the refit is waiting for `before` to finish
            time.sleep(0.001)
        after = engine.submit(request(prompts[2], max_new_tokens=4, seed=2))
        first = before.result(timeout=60)
        refit.join(timeout=60)
        second = after.result(timeout=60)
    finally:
        log.close()
        engine.close()
    assert not refit.is_alive()
    assert (first.weight_version, second.weight_version) == (0, 1)
    assert len(first.token_ids) == 60


def test_close_fails_what_is_not_answered_and_refuses_new_requests(model, prompts):
    engine = make_engine(model, max_batch_size=1)
    running = engine.submit(request(prompts[1], max_new_tokens=400, seed=1))
    queued = engine.submit(request(prompts[2], max_new_tokens=4, seed=2))
    engine.close()
    for future in (running, queued):
        with pytest.raises(EngineClosedError):
            future.result(timeout=30)
    with pytest.raises(EngineClosedError, match="closed"):
        engine.submit(request(prompts[0])).result(timeout=5)


def test_a_failed_step_stops_the_engine_for_good_with_its_own_error(model, prompts, monkeypatch):
    """One failed step ends the engine (see `TorchGenerationEngine`): the rows it held, the rows
    queued, every later request and a refit all fail with the step's error, kept as
    `failure()`; a plainly closed engine has none."""
    engine = make_engine(model, max_batch_size=1)
    assert engine.failure() is None

    def broken_step(batch):
        raise RuntimeError("the device fell over")

    monkeypatch.setattr(engine, "_decode_step", broken_step)
    running = engine.submit(request(prompts[1], max_new_tokens=40, seed=1))
    queued = engine.submit(request(prompts[2], max_new_tokens=4, seed=2))
    for future in (running, queued):
        with pytest.raises(EngineFailedError, match="RuntimeError: the device fell over") as error:
            future.result(timeout=30)
        assert isinstance(error.value.__cause__, RuntimeError)
    failure = engine.failure()
    assert isinstance(failure, EngineFailedError)
    assert "stopped after a failed step" in str(failure)
    with pytest.raises(EngineFailedError, match="the device fell over"):
        engine.submit(request(prompts[0])).result(timeout=5)
    with pytest.raises(EngineFailedError, match="the device fell over"):
        engine.update_weights(model.state_dict(), version=1)
    assert engine.weight_version == 0
    engine.close()
    closed = make_engine(model)
    closed.generate([request(prompts[0])])
    closed.close()
    assert closed.failure() is None


def test_the_counters_add_up_what_the_engine_did(model, prompts):
    engine = make_engine(model, max_batch_size=2)
    requests = [request(p, max_new_tokens=3 + i, seed=i) for i, p in enumerate(prompts[:3])]
    engine.record_timeline()
    outputs = engine.generate(requests)
    counters, timeline = engine.counters(), engine.timeline()
    engine.close()
    generated = sum(len(o.token_ids) for o in outputs)
    assert counters.generated_tokens == generated
    assert counters.prefill_tokens == sum(len(p) for p in prompts[:3])
    # Every token but each row's first (sampled at prefill) came from a decode step.
    assert counters.decode_rows == generated - len(requests)
    assert 1 <= counters.decode_rows / counters.decode_steps <= 2
    assert counters.busy_s > 0
    # The timeline holds the same iterations, in order.
    assert sum(s.decoded_rows for s in timeline) == counters.decode_rows
    assert sum(s.admitted for s in timeline) == len(requests)
    assert all(a.end_s <= b.start_s for a, b in itertools.pairwise(timeline))
    assert sum(s.answered for s in timeline) == len(requests)
    # Three requests for two slots: the first iteration leaves one queued, the last none.
    assert (timeline[0].admitted, timeline[0].waiting) == (2, 1)
    assert timeline[-1].waiting == 0
    for step in timeline:
        phases = step.prefill_s + step.rebuild_s + step.decode_s
        assert min(step.prefill_s, step.rebuild_s, step.decode_s) >= 0
        assert phases == pytest.approx(step.end_s - step.start_s)
    assert engine.timeline() == []  # recording stopped


def count_fed_tokens(model) -> tuple[list[int], torch.utils.hooks.RemovableHandle]:
    """Tokens fed to the model per forward pass (a prefill pass feeds only what it computes)."""
    fed: list[int] = []
    handle = model.base_model.register_forward_pre_hook(
        lambda _module, _args, kwargs: fed.append(kwargs["input_ids"].numel()), with_kwargs=True
    )
    return fed, handle


def test_a_next_turn_prefills_only_what_follows_the_cached_turn(model, prompts):
    """Turn 2's prompt is turn 1's prompt, its answer and new text: the engine reuses the keys
    and values turn 1 computed and feeds the model only the rest, with the log-probabilities of
    a full teacher-forced pass and the tokens an engine without the cache samples."""
    engine = make_engine(model)
    first = engine.generate([request(prompts[1], temperature=1.0, seed=1, max_new_tokens=6)])[0]
    follow_up = first.prompt_token_ids + first.token_ids + prompts[3]
    turn_two = request(follow_up, temperature=1.0, seed=2, max_new_tokens=6)
    fed, handle = count_fed_tokens(model)
    try:
        second = engine.generate([turn_two])[0]
    finally:
        handle.remove()
    cached = len(first.prompt_token_ids) + len(first.token_ids) - 1  # all but its last token
    assert engine.counters().reused_tokens == cached
    assert fed[0] == len(follow_up) - cached
    expected = reference_logprobs(model, second, temperature=1.0)
    torch.testing.assert_close(torch.tensor(second.logprobs), expected, atol=1e-4, rtol=0)
    uncached = make_engine(model, prefix_cache_tokens=0).generate([turn_two])[0]
    assert second.token_ids == uncached.token_ids


def test_rows_with_different_cached_prefixes_prefill_in_one_pass(model, prompts):
    """Two follow-ups of different cached turns and two fresh prompts are admitted together:
    each new token must attend to its own row's prefix only (a mask letting it see another
    row's prefix, or wrong positions, changes the log-probabilities)."""
    engine = make_engine(model, max_batch_size=4)
    firsts = engine.generate(
        [request(p, max_new_tokens=4, seed=i) for i, p in enumerate(prompts[1:3])]
    )
    fresh = [prompts[0], prompts[3]]
    follow_ups = [o.prompt_token_ids + o.token_ids + prompts[4] for o in firsts]
    requests = [
        request(p, temperature=0.7, max_new_tokens=5, seed=10 + i)
        for i, p in enumerate(follow_ups + fresh)
    ]
    reused_before = engine.counters().reused_tokens
    fed, handle = count_fed_tokens(model)
    try:
        outputs = engine.generate(requests)
    finally:
        handle.remove()
    cached = sum(len(o.prompt_token_ids) + len(o.token_ids) - 1 for o in firsts)
    assert engine.counters().reused_tokens - reused_before >= cached
    assert fed[0] <= sum(len(p) for p in follow_ups + fresh) - cached  # one packed prefill
    for output in outputs:
        expected = reference_logprobs(model, output, temperature=0.7)
        torch.testing.assert_close(torch.tensor(output.logprobs), expected, atol=1e-4, rtol=0)


def test_a_refit_drops_the_cached_prefixes(tokenizer, prompts):
    """Keys and values belong to the weights that computed them: after a refit a follow-up
    prefills in full and matches the new weights."""
    engine = make_engine(tiny_llama(tokenizer, seed=0))
    first = engine.generate([request(prompts[1], max_new_tokens=4, seed=1)])[0]
    new_model = tiny_llama(tokenizer, seed=1)
    engine.update_weights(new_model.state_dict(), version=1)
    follow_up = first.prompt_token_ids + first.token_ids + prompts[3]
    second = engine.generate([request(follow_up, temperature=1.0, max_new_tokens=4, seed=2)])[0]
    assert engine.counters().reused_tokens == 0
    expected = reference_logprobs(new_model, second, temperature=1.0)
    torch.testing.assert_close(torch.tensor(second.logprobs), expected, atol=1e-4, rtol=0)


def test_a_group_admitted_together_computes_its_shared_prompt_once(model, prompts):
    """Four episodes of one group start from one prompt: the first prefills it, the other three
    wait for its keys and values and compute only their last token, sampling as if alone."""
    shared = prompts[1] * 4  # long enough that waiting pays (plan_prefill's MIN_SHARED_GAIN)
    requests = [request(shared, temperature=1.0, max_new_tokens=4, seed=i) for i in range(4)]
    engine = make_engine(model, max_batch_size=4)
    fed, handle = count_fed_tokens(model)
    try:
        outputs = engine.generate(requests)
    finally:
        handle.remove()
    assert fed[:2] == [len(shared), 3]  # the leader, then the three others' last tokens
    assert engine.counters().reused_tokens == 3 * (len(shared) - 1)
    uncached = make_engine(model, prefix_cache_tokens=0, max_batch_size=4).generate(requests)
    for output, alone in zip(outputs, uncached, strict=True):
        assert output.token_ids == alone.token_ids
        expected = reference_logprobs(model, output, temperature=1.0)
        torch.testing.assert_close(torch.tensor(output.logprobs), expected, atol=1e-4, rtol=0)

"""The torch engine's fused decode step (`generation.decode_path`,
gymrl/generation/torch/llama_decode.py) against the model's own forward: the same tokens and
log-probabilities, through continuous batching, the prefix cache and a refit, on a tiny random
Llama with grouped key/value heads (and on SmolLM2-135M-Instruct, slow)."""

from __future__ import annotations

import copy
import random
import statistics

import pytest
import torch
from transformers import LlamaForCausalLM

from gymrl.config.schema.generation import TorchGenerationConfig
from gymrl.config.schema.grpo import ParityGateConfig
from gymrl.generation.torch.engine import TorchGenerationEngine, _DecodeBatch
from gymrl.generation.torch.llama_decode import unsupported_reason
from gymrl.generation.types import GenerationOutput, GenerationRequest, SamplingParams
from gymrl.model.loading import build_tiny_llama, load_pretrained
from gymrl.model.precision import body_autocast

TEXTS = [
    "Hello there!",
    "Summarise the plot of a long novel about whales, the sea, and obsession.",
    "2+2=",
    "Write one line of Python that reverses a list called items.",
    "ok",
]


def gqa_llama(tokenizer, seed: int, **overrides) -> LlamaForCausalLM:
    """A tiny random Llama whose 4 query heads share 2 key/value heads (as SmolLM2's 9 share 3),
    over the tokenizer's vocabulary but none of its special ids."""
    return build_tiny_llama(
        len(tokenizer),
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=96,
        seed=seed,
        max_position_embeddings=4096,
        **overrides,
    ).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(text) for text in TEXTS]


def make_engine(
    model, decode_path: str = "fused", *, compute_dtype="float32", **generation
) -> TorchGenerationEngine:
    config = TorchGenerationConfig(
        **({"max_batch_size": 3, "decode_path": decode_path} | generation)
    )
    return TorchGenerationEngine.from_config(model, config, seed=0, compute_dtype=compute_dtype)


def requests_for(prompts, temperature: float, **params) -> list[GenerationRequest]:
    """Five prompts of different lengths and lengths to generate: through three slots, rows
    finish at different steps and queued ones join the rows decoding."""
    return [
        GenerationRequest(
            prompt,
            SamplingParams(
                **({"max_new_tokens": 4 + 3 * i, "temperature": temperature, "seed": i} | params)
            ),
        )
        for i, prompt in enumerate(prompts)
    ]


def recomputed_logprobs(model, output: GenerationOutput, compute: torch.dtype | None):
    """The log-probabilities of `output`'s tokens from one pass over prompt + tokens, the way the
    trainer computes them (the body under `compute` autocast, the output layer outside it)."""
    ids = torch.tensor([output.prompt_token_ids + output.token_ids])
    with torch.no_grad():
        with body_autocast(torch.device("cpu"), compute):
            hidden = model.base_model(input_ids=ids).last_hidden_state
        logits = model.lm_head(hidden.float())[0]
    start = len(output.prompt_token_ids) - 1
    predicting = logits[start : start + len(output.token_ids)]
    tokens = torch.tensor(output.token_ids)[:, None]
    return torch.log_softmax(predicting, -1).gather(1, tokens).squeeze(1)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fused_decoding_matches_the_models_own_in_float32(tokenizer, prompts, temperature):
    reference = gqa_llama(tokenizer, seed=0)
    fused, plain = make_engine(copy.deepcopy(reference)), make_engine(reference, "transformers")
    assert (fused.decode_path, plain.decode_path) == ("fused", "transformers")
    requests = requests_for(prompts, temperature)
    for mine, theirs in zip(fused.generate(requests), plain.generate(requests), strict=True):
        assert mine.token_ids == theirs.token_ids
        torch.testing.assert_close(mine.logprobs, theirs.logprobs, atol=1e-5, rtol=0)
        expected = recomputed_logprobs(reference, mine, None)
        torch.testing.assert_close(torch.tensor(mine.logprobs), expected, atol=1e-4, rtol=0)


def test_without_onednn_the_fused_step_multiplies_the_plain_weights(
    tokenizer, prompts, monkeypatch
):
    """Where the weights cannot be packed (no oneDNN; a GPU), the same step runs on them as
    they are."""
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    reference = gqa_llama(tokenizer, seed=0)
    fused = make_engine(copy.deepcopy(reference))
    assert fused._decoder is not None and not fused._decoder._products._packed
    requests = requests_for(prompts, 1.0)
    plain = make_engine(reference, "transformers").generate(requests)
    for mine, theirs in zip(fused.generate(requests), plain, strict=True):
        assert mine.token_ids == theirs.token_ids
        torch.testing.assert_close(mine.logprobs, theirs.logprobs, atol=1e-5, rtol=0)


def test_fused_decoding_in_bfloat16_is_the_trainers_recomputation(tokenizer, prompts):
    """Under bfloat16 the fused step rounds where the model's step does, but its attention sums in
    another order: within the rounding that separates cached decoding from one pass anyway."""
    reference = gqa_llama(tokenizer, seed=0)
    engine = make_engine(copy.deepcopy(reference), compute_dtype="bfloat16")
    assert engine.decode_path == "fused"
    for output in engine.generate(requests_for(prompts, 1.0, max_new_tokens=10)):
        expected = recomputed_logprobs(reference, output, torch.bfloat16)
        error = (torch.tensor(output.logprobs) - expected).abs()
        assert float(error.max()) < 0.05, error


def test_the_prefix_cache_serves_a_fused_engine(tokenizer, prompts):
    """A next turn reuses the keys and values the fused step wrote, as the model's step would."""
    model = gqa_llama(tokenizer, seed=0)
    engine = make_engine(model)
    first = engine.generate(requests_for(prompts[1:2], 1.0, max_new_tokens=6))[0]
    follow_up = first.prompt_token_ids + first.token_ids + prompts[3]
    turn_two = requests_for([follow_up], 1.0, max_new_tokens=6, seed=2)
    second = engine.generate(turn_two)[0]
    assert engine.counters().reused_tokens == len(first.prompt_token_ids) + 6 - 1
    uncached = make_engine(model, "transformers", prefix_cache_tokens=0).generate(turn_two)[0]
    assert second.token_ids == uncached.token_ids
    torch.testing.assert_close(second.logprobs, uncached.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_a_refit_reaches_the_fused_weights(tokenizer, prompts, compute_dtype):
    """The fused step reads packed copies of the weights: a refit must renew them."""
    engine = make_engine(gqa_llama(tokenizer, seed=0), compute_dtype=compute_dtype)
    names = {name: tensor.dtype for name, tensor in engine._model.state_dict().items()}
    assert engine.weight_dtypes() == names  # the fused layout keeps the model's state dict
    requests = requests_for(prompts, 0.0)
    before = engine.generate(requests)
    new_model = gqa_llama(tokenizer, seed=1)
    engine.update_weights(new_model.state_dict(), version=1)
    after = engine.generate(requests)
    fresh = make_engine(new_model, compute_dtype=compute_dtype).generate(requests)
    assert [o.token_ids for o in after] == [o.token_ids for o in fresh]
    assert [o.logprobs for o in after] == [o.logprobs for o in fresh]
    assert [o.token_ids for o in after] != [o.token_ids for o in before]


def test_auto_falls_back_for_a_model_it_does_not_cover_and_fused_refuses_it(tokenizer, prompts):
    biased = gqa_llama(tokenizer, seed=0, attention_bias=True)
    assert unsupported_reason(biased) == "config.attention_bias is true (projections with biases)"
    assert make_engine(biased, "auto").decode_path == "transformers"
    with pytest.raises(ValueError, match="decode_path=fused cannot decode LlamaForCausalLM"):
        make_engine(biased, "fused")
    eager = gqa_llama(tokenizer, seed=0, attn_implementation="eager")
    assert "'eager'" in str(unsupported_reason(eager))
    assert make_engine(gqa_llama(tokenizer, seed=0), "auto").decode_path == "fused"


@pytest.mark.slow
def test_smollm2_fused_decoding_is_within_the_parity_gate(tokenizer, smollm2_dir):
    """The real model in bfloat16: the fused engine's log-probabilities against the trainer's
    recomputation are within the parity gate's bfloat16 tolerance, as the model's own step's are,
    and both steps pick the same greedy tokens."""
    model = load_pretrained(smollm2_dir, torch.float32)
    chats = [
        "What is 17 times 23?",
        "Name three primary colours.",
        "Write one sentence about the sea.",
        "Explain what a prime number is.",
    ]
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": chat}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
        )
        for chat in chats
    ]
    tolerance = ParityGateConfig().bfloat16
    outputs = {}
    for path in ("fused", "transformers"):
        engine = make_engine(copy.deepcopy(model), path, compute_dtype="bfloat16", max_batch_size=4)
        sampled = engine.generate(requests_for(prompts, 1.0, max_new_tokens=24))
        greedy = engine.generate(requests_for(prompts, 0.0, max_new_tokens=8))
        outputs[path] = greedy
        errors = [
            float(error)
            for output in sampled
            for error in (
                torch.tensor(output.logprobs) - recomputed_logprobs(model, output, torch.bfloat16)
            ).abs()
        ]
        assert statistics.mean(errors) <= tolerance.logprob_diff_mean, (path, errors)
        assert max(errors) <= tolerance.logprob_diff_max, (path, errors)
    fused, plain = outputs["fused"], outputs["transformers"]
    assert [o.token_ids for o in fused] == [o.token_ids for o in plain]


def test_fused_decoding_matches_the_models_own_past_every_growth_of_the_cache(tokenizer):
    """Generations far longer than the room a decode batch reserves (`_DECODE_ROOM`): the cache
    grows several times, at different steps as rows finish and queued rows join, and the fused
    step's mask must cover every column the grown cache holds. Greedy rows give the model's own
    tokens; sampled rows' log-probabilities are the one-pass recomputation of their tokens
    (their tokens may differ from the other path's: on a random model the vocabulary is nearly
    uniform, and a 1e-6 difference moves an inverse-CDF draw to the next id)."""
    reference = gqa_llama(tokenizer, seed=0)
    fused, plain = make_engine(copy.deepcopy(reference)), make_engine(reference, "transformers")
    rng = random.Random(0)
    requests = [
        GenerationRequest(
            [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))],
            SamplingParams(
                max_new_tokens=rng.randrange(60, 300), temperature=index % 2 * 1.0, seed=index
            ),
        )
        for index in range(7)
    ]
    outputs = fused.generate(requests)
    for request, mine, theirs in zip(requests, outputs, plain.generate(requests), strict=True):
        assert len(mine.token_ids) == request.params.max_new_tokens
        if request.params.temperature == 0:
            assert mine.token_ids == theirs.token_ids
            torch.testing.assert_close(mine.logprobs, theirs.logprobs, atol=1e-5, rtol=0)
        expected = recomputed_logprobs(reference, mine, None)
        torch.testing.assert_close(torch.tensor(mine.logprobs), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("decode_path", ["fused", "transformers"])
def test_rows_joining_and_leaving_a_decoding_batch_move_only_their_own_slots(
    tokenizer, decode_path, monkeypatch
):
    """Short requests pass through a batch while long ones decode: each one that leaves hands
    its slot to a kept row or an arrival, in place, and every row's log-probabilities stay the
    one-pass recomputation of its tokens (padding, moved slots and reused slots all masked)."""
    rebuilds, repacks = [], []
    rebuild, repack = _DecodeBatch.rebuild, _DecodeBatch._repack
    monkeypatch.setattr(
        _DecodeBatch, "rebuild", lambda self, *a: rebuilds.append(1) or rebuild(self, *a)
    )
    monkeypatch.setattr(
        _DecodeBatch, "_repack", lambda self, *a: repacks.append(1) or repack(self, *a)
    )
    reference = gqa_llama(tokenizer, seed=0)
    engine = make_engine(copy.deepcopy(reference), decode_path, max_batch_size=4)
    rng = random.Random(1)

    def request(index: int, prompt: int, new: int) -> GenerationRequest:
        tokens = [rng.randrange(len(tokenizer)) for _ in range(prompt)]
        params = SamplingParams(max_new_tokens=new, temperature=index % 2 * 1.0, seed=index)
        return GenerationRequest(tokens, params)

    long = [request(i, rng.randrange(60, 80), rng.randrange(70, 110)) for i in range(2)]
    short = [request(i, rng.randrange(5, 40), rng.randrange(2, 12)) for i in range(2, 14)]
    requests = long + short
    outputs = engine.generate(requests)
    engine.close()
    in_place = len(rebuilds) - len(repacks)
    assert in_place >= len(short) // 2, (len(rebuilds), len(repacks))
    for request_, output in zip(requests, outputs, strict=True):
        assert len(output.token_ids) == request_.params.max_new_tokens
        expected = recomputed_logprobs(reference, output, None)
        torch.testing.assert_close(torch.tensor(output.logprobs), expected, atol=1e-4, rtol=0)

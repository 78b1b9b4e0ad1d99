"""Throughput of TorchGenerationEngine against `transformers` `generate`, side by side.

Both sample (temperature 1, top-p 1) 64 new tokens per prompt from SmolLM2-135M-Instruct for a
batch of chat prompts of different lengths, and both return the sampled tokens' log-probabilities.
They share one model object (same weights), each gets a warm-up run, and the repetitions alternate
between the two so that drift of a shared machine hits both alike. Tokens are counted honestly:
for `generate`, each row's tokens up to and including its first stop token, never padding.

    python benchmarks/bench_engine.py --repeats 3
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gymrl.config.schema.generation import TorchGenerationConfig
from gymrl.generation.torch.engine import TorchGenerationEngine
from gymrl.generation.types import GenerationRequest, SamplingParams
from gymrl.model.loading import ensure_smollm2_checkpoint, load_pretrained, load_tokenizer

CHATS = [
    [{"role": "user", "content": "What is 17 times 23?"}],
    [
        {"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    [{"role": "user", "content": "Write a haiku about a cat sleeping in the sun."}],
    [
        {
            "role": "user",
            "content": "I have a list of numbers: 4, 8, 15, 16, 23, 42. Compute their sum, their "
            "mean, and say which of them are prime. Explain each step briefly before giving "
            "the final answers.",
        }
    ],
    [{"role": "user", "content": "Translate 'good morning, how are you?' into French."}],
    [
        {"role": "system", "content": "You help people plan their week."},
        {"role": "user", "content": "Suggest three short workouts I can do at home."},
    ],
]


def chat_prompts(tokenizer: PreTrainedTokenizerBase, batch_size: int) -> list[list[int]]:
    """`batch_size` prompts cycling through CHATS, rendered by the chat template."""
    rendered = [
        list(
            tokenizer.apply_chat_template(
                chat, add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        for chat in CHATS
    ]
    return [rendered[i % len(rendered)] for i in range(batch_size)]


def run_generate(
    model: PreTrainedModel, prompts: Sequence[list[int]], new_tokens: int, stop_ids: set[int]
) -> int:
    """Sample with `model.generate` (left padding), compute the log-probabilities, count tokens."""
    width = max(len(prompt) for prompt in prompts)
    pad = min(stop_ids)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=new_tokens,
            pad_token_id=pad,
            eos_token_id=sorted(stop_ids),
            output_scores=True,
            return_dict_in_generate=True,
        )
        generated = out.sequences[:, width:]
        scores = torch.stack(out.scores, dim=1).float()
        logprobs = torch.log_softmax(scores, dim=-1).gather(2, generated.unsqueeze(2)).squeeze(2)
    assert torch.isfinite(logprobs).all()
    total = 0
    for row in generated.tolist():
        stops = [i for i, token in enumerate(row) if token in stop_ids]
        total += stops[0] + 1 if stops else len(row)
    return total


def run_engine(engine: TorchGenerationEngine, prompts: Sequence[list[int]], new_tokens: int) -> int:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, top_p=1.0)
    outputs = engine.generate([GenerationRequest(prompt, params) for prompt in prompts])
    return sum(len(output.token_ids) for output in outputs)


def timed(run: Callable[[], int]) -> tuple[float, int]:
    start = time.perf_counter()
    tokens = run()
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--compute-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="the engine's policy.compute_dtype (generate always runs float32)",
    )
    parser.add_argument(
        "--decode-path",
        choices=["auto", "fused", "transformers"],
        default=TorchGenerationConfig().decode_path,
        help="the engine's generation.decode_path",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's own choice, one per core)",
    )
    parser.add_argument(
        "--cache-dir", type=Path, default=Path("~/.cache/gym-grpo-recipes/models").expanduser()
    )
    args = parser.parse_args()

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    path = ensure_smollm2_checkpoint(args.cache_dir)
    tokenizer = load_tokenizer(path)
    model = load_pretrained(path, torch.float32)
    stop_ids = {tokenizer.eos_token_id}
    torch.manual_seed(args.seed)
    print(
        f"torch threads: {torch.get_num_threads()}, compute dtype: {args.compute_dtype}, "
        f"decode path: {args.decode_path}, new tokens: {args.new_tokens}"
    )

    rows = []
    for batch_size in args.batch_sizes:
        prompts = chat_prompts(tokenizer, batch_size)
        generation = TorchGenerationConfig(
            max_batch_size=batch_size,
            # Off: the repeats send the same prompts, which the cache would answer from memory;
            # this measures the engine's own prefill and decoding against `generate`'s.
            prefix_cache_tokens=0,
            decode_path=args.decode_path,
        )
        engine = TorchGenerationEngine.from_config(
            copy.deepcopy(model),  # the engine owns its model (bfloat16 rounds its weights)
            generation,
            seed=args.seed,
            compute_dtype=args.compute_dtype,
            eos_token_ids=stop_ids,
        )
        contenders: dict[str, Callable[[], int]] = {
            "generate": lambda p=prompts: run_generate(model, p, args.new_tokens, stop_ids),
            "engine": lambda e=engine, p=prompts: run_engine(e, p, args.new_tokens),
        }
        for run in contenders.values():
            run()  # warm-up
        rates: dict[str, list[float]] = {name: [] for name in contenders}
        counts: dict[str, list[int]] = {name: [] for name in contenders}
        for _ in range(args.repeats):
            for name, run in contenders.items():
                seconds, tokens = timed(run)
                rates[name].append(tokens / seconds)
                counts[name].append(tokens)
        lengths = sorted(len(p) for p in prompts)
        print(f"batch {batch_size}: prompt lengths {lengths[0]}..{lengths[-1]}")
        for name in contenders:
            print(f"  {name:9s} tok/s per repeat {[round(r, 1) for r in rates[name]]}")
        generate_rate = statistics.median(rates["generate"])
        engine_rate = statistics.median(rates["engine"])
        rows.append(
            (
                batch_size,
                generate_rate,
                statistics.mean(counts["generate"]) / batch_size,
                engine_rate,
                statistics.mean(counts["engine"]) / batch_size,
                engine_rate / generate_rate,
            )
        )

    print()
    print(f"median of {args.repeats} repeats")
    print("| batch | generate tok/s | tokens/row | engine tok/s | tokens/row | engine/generate |")
    print("|---:|---:|---:|---:|---:|---:|")
    for batch_size, gen_rate, gen_len, eng_rate, eng_len, ratio in rows:
        print(
            f"| {batch_size} | {gen_rate:.1f} | {gen_len:.1f} | {eng_rate:.1f} | {eng_len:.1f} "
            f"| {ratio:.2f}x |"
        )


if __name__ == "__main__":
    main()

"""The parity gate's figures on the embedded model: how far the torch trainer's log-probabilities
of sampled tokens are from the torch engine's, with the same weights, per compute dtype.

Both sides load SmolLM2-135M-Instruct as the embedded default does (`build_policy`); the engine
(`TorchGenerationEngine`, its body's matmul weights rounded once under bfloat16) samples
`--episodes` replies to chat prompts at the default temperature, and the trainer
(`TorchPolicyTrainer`) recomputes them in one train step (advantages 0, so the weights do not
move) whose metrics are exactly what the gate reads at a run's first step
(`gymrl.algo.loss.finish_agent_statistics`). Prints the figures and the gate's verdict against
`grpo.parity_gate`'s default tolerances, for each of the engine's decode paths
(`generation.decode_path`: the model's forward, or the fused step of
gymrl/generation/torch/llama_decode.py).

    python benchmarks/bench_parity.py --threads 2
    python benchmarks/bench_parity.py --threads 2 --dtypes float32 --episodes 32
"""

from __future__ import annotations

import argparse
import time

import torch

from gymrl.algo.loss import finish_agent_statistics
from gymrl.algo.trajectory import Trajectory
from gymrl.config.compose import compose_raw
from gymrl.config.schema.generation import TorchGenerationConfig
from gymrl.generation.torch.engine import TorchGenerationEngine
from gymrl.generation.types import GenerationRequest, SamplingParams
from gymrl.model.policy import build_policy
from gymrl.model.tokens import eos_token_id, pad_token_id
from gymrl.preflight.validate import validate_config
from gymrl.trainer.parity_gate import parity_problems
from gymrl.trainer.torch_trainer import TorchPolicyTrainer

QUESTIONS = [
    "What is 17 times 23?",
    "Name three primary colours.",
    "Write one sentence about the sea.",
    "Guess a number between 1 and 100.",
    "What is the capital of France?",
    "Explain what a prime number is.",
    "Add 128 and 256.",
    "Give me a synonym for quick.",
]


def figures_for(
    dtype: str, decode_path: str, episodes: int, max_new_tokens: int
) -> dict[str, float]:
    config = validate_config(
        compose_raw([f"policy.compute_dtype={dtype}", f"generation.decode_path={decode_path}"])
    )
    assert isinstance(config.generation, TorchGenerationConfig)
    policy, temperature = config.policy, config.generation.sampling.temperature
    engine_model, tokenizer = build_policy(policy, seed=0)
    trainer_model, _ = build_policy(policy, seed=0)
    engine = TorchGenerationEngine.from_config(
        engine_model,
        config.generation,
        seed=0,
        compute_dtype=policy.compute_dtype,
        eos_token_ids=[eos_token_id(tokenizer)],
    )
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for i in range(episodes)
    ]
    prompts = [tokenizer.encode(str(text), add_special_tokens=False) for text in texts]
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=None)
    outputs = engine.generate([GenerationRequest(prompt, params) for prompt in prompts])
    trajectories = [
        Trajectory(
            token_ids=[*prompt, *out.token_ids],
            loss_mask=[0] * len(prompt) + [1] * len(out.token_ids),
            generation_logprobs=[0.0] * len(prompt) + list(out.logprobs),
            reward=0.0,
            agent="chat",
            group_id=f"g{index}",
            weight_version=0,
        )
        for index, (prompt, out) in enumerate(zip(prompts, outputs, strict=True))
    ]
    trainer = TorchPolicyTrainer(
        trainer_model,
        config.trainer,  # pyright: ignore[reportArgumentType]  (the default is the torch trainer)
        config.loss,
        temperature=temperature,
        pad_token_id=pad_token_id(tokenizer),
        keep_last_checkpoints=1,
        compute_dtype=policy.compute_dtype,
    )
    started = time.perf_counter()
    metrics = trainer.train_step(trajectories, torch.zeros(len(trajectories)))
    figures = finish_agent_statistics(metrics)["chat"]
    tolerance = getattr(config.grpo.parity_gate, trainer.compute_dtype)
    problems = parity_problems({"chat": figures}, tolerance)
    return {
        **figures,
        "tokens": metrics["num_tokens"],
        "train_s": time.perf_counter() - started,
        "resolved": trainer.compute_dtype,
        "passed": not problems,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--decode-paths",
        nargs="+",
        default=["transformers", "fused"],
        help="the engine's generation.decode_path values to compare",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch threads {torch.get_num_threads()}, {args.episodes} episodes")
    print(
        "| compute dtype | decode path | tokens | mean abs diff | max abs diff | ratio std "
        "| ratio min | ratio max | gate |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for dtype in args.dtypes:
        for path in args.decode_paths:
            print_figures(dtype, path, figures_for(dtype, path, args.episodes, args.max_new_tokens))


def print_figures(dtype: str, path: str, f: dict[str, float]) -> None:
    print(
        f"| {dtype} (resolved {f['resolved']}) | {path} | {f['tokens']:.0f} | "
        f"{f['logprob_diff/mean']:.2e} | {f['logprob_diff/max']:.2e} | {f['ratio/std']:.2e} | "
        f"{f['ratio/min']:.4f} | {f['ratio/max']:.4f} | {'pass' if f['passed'] else 'FAIL'} |",
        flush=True,
    )


if __name__ == "__main__":
    main()

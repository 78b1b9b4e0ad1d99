"""LoRA on the embedded SmolLM2-135M-Instruct: how the torch engine should apply an adapter, and
what LoRA saves the trainer.

    python benchmarks/bench_lora.py engine --threads 2 --repeats 3
    python benchmarks/bench_lora.py trainer --mode full --threads 2   # one trainer per process,
    python benchmarks/bench_lora.py trainer --mode lora --threads 2   # so peak memory is its own

`engine`: one adapter of the default `trainer.lora` (rank 16, alpha 32, every Linear of the 30
layers; B drawn at random, as training leaves it) applied to the engine three ways, each on its
own copy of the model:

* `merged`: what `TorchGenerationEngine.update_adapter` does, base + scaling x B @ A written into
  the weights (a kept copy of the base), decoding through the engine's default path (fused);
* `merged, transformers`: the same weights, decoding through the model's own forward: the
  control that separates the cost of the adapter from that of the decode path;
* `unmerged`: PEFT's LoRA layers left in the model (`inject_adapter_in_model`), the adapter's
  two low-rank products added at every adapted layer and token; a refit copies the factors in.
  The fused step reads weights, not modules, so this one decodes through the model's forward.

Each refit is timed (median over `--repeats`, one adapter per refit), then each generates 64
greedy tokens for 16 chat prompts (the repetitions alternate between the three, so a shared
machine's drift hits all alike; tokens/s counts generated tokens). A full refit of every weight
(`update_weights`, what a full-training run moves) is timed for scale.

`trainer`: `TorchPolicyTrainer.train_step` on the `bench_trainer.py` shared-prefix batch (4 groups
x 4 episodes of the embedded calculator task's shape), full training or the default LoRA:
seconds per step, parameters in the optimizer, bytes of gradients and AdamW moments, peak
resident memory of the process, and the bytes a refit moves (full: every weight in the engine's
dtypes; LoRA: the adapter).
"""

from __future__ import annotations

import argparse
import copy
import resource
import statistics
import time
from collections.abc import Callable

import torch
from bench_trainer import shared_prefix_episodes
from peft import LoraConfig as PeftLoraConfig
from peft import inject_adapter_in_model, set_peft_model_state_dict

from gymrl.config.compose import compose_raw
from gymrl.config.schema.generation import TorchGenerationConfig
from gymrl.config.schema.loss import LossConfig
from gymrl.config.schema.trainer import LoraConfig, TorchOptimizerConfig, TorchTrainerConfig
from gymrl.generation.torch.engine import TorchGenerationEngine
from gymrl.generation.types import GenerationRequest, SamplingParams
from gymrl.model.policy import build_policy
from gymrl.model.tokens import pad_token_id
from gymrl.preflight.validate import validate_config
from gymrl.run.adapter import AdapterWeights
from gymrl.trainer.torch_trainer import TorchPolicyTrainer

PROMPTS = [
    "What is 17 times 23?",
    "Write a haiku about the sea.",
    "Explain recursion to a child in two sentences.",
    "List three prime numbers above 100.",
]
NEW_TOKENS = 64
BATCH = 16


def _adapters(model, lora: LoraConfig, count: int) -> list[AdapterWeights]:
    """`count` adapters of `lora`'s shape for `model`, each with B drawn at random."""
    trainer = TorchPolicyTrainer(
        copy.deepcopy(model),
        TorchTrainerConfig(lora=lora),
        LossConfig(kl_coef=0.0),
        temperature=1.0,
        pad_token_id=0,
        keep_last_checkpoints=1,
        compute_dtype="float32",
    )
    adapters = []
    with torch.no_grad():
        for _ in range(count):
            for name, parameter in trainer.model.named_parameters():
                if ".lora_B." in name:
                    parameter.normal_(0.0, 0.01)
            adapters.append(trainer.export_adapter())
    return adapters


def _engine(model, decode_path: str) -> TorchGenerationEngine:
    config = TorchGenerationConfig.model_validate(
        {"max_batch_size": BATCH, "decode_path": decode_path}
    )
    return TorchGenerationEngine.from_config(model, config, seed=0, compute_dtype="auto")


def _unmerged_refit(engine: TorchGenerationEngine, model) -> Callable[[AdapterWeights, int], None]:
    """A refit that copies the factors into PEFT's layers in the engine's model, through the
    engine's own refit (drained rows, the lock, the prefix cache cleared) as `update_adapter`."""

    def refit(adapter: AdapterWeights, version: int) -> None:
        def load() -> None:
            set_peft_model_state_dict(model, adapter.tensors)

        engine._refit(load, version)

    return refit


def engine_part(args: argparse.Namespace) -> None:
    policy = validate_config(compose_raw([])).policy
    model, tokenizer = build_policy(policy, seed=0)
    lora = LoraConfig(enabled=True)
    adapters = _adapters(model, lora, args.repeats + 1)
    merged = _engine(copy.deepcopy(model), "auto")
    merged_transformers = _engine(copy.deepcopy(model), "transformers")
    peft_model = inject_adapter_in_model(
        PeftLoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,
            target_modules=list(lora.target_modules),
            bias="none",
        ),
        copy.deepcopy(model),
    )
    unmerged = _engine(peft_model, "transformers")
    refits = {
        "merged": merged.update_adapter,
        "merged, transformers": merged_transformers.update_adapter,
        "unmerged": _unmerged_refit(unmerged, peft_model),
    }
    engines = {
        "merged": merged,
        "merged, transformers": merged_transformers,
        "unmerged": unmerged,
    }
    print(
        f"torch threads {torch.get_num_threads()}; adapter rank {lora.rank} on "
        f"{len(adapters[0].module_pairs())} modules, {adapters[0].num_bytes / 2**20:.1f} MiB; "
        f"decode paths: merged {merged.decode_path}, unmerged {unmerged.decode_path}"
    )
    refit_s: dict[str, list[float]] = {name: [] for name in refits}
    for version, adapter in enumerate(adapters, start=1):
        for name, refit in refits.items():
            started = time.perf_counter()
            refit(adapter, version)
            if version > 1:  # the first merged refit also copies the base weights
                refit_s[name].append(time.perf_counter() - started)
    full_state = {k: v.clone() for k, v in merged._model.state_dict().items()}
    full_s = []
    for version in range(len(adapters) + 1, len(adapters) + 1 + args.repeats):
        started = time.perf_counter()
        merged.update_weights(full_state, version)
        full_s.append(time.perf_counter() - started)
    full_bytes = sum(t.numel() * t.element_size() for t in full_state.values())
    # The merged engine was refitted with full weights; give it the adapter back.
    merged.update_adapter(adapters[-1], len(adapters) + args.repeats + 1)

    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
        )
        for text in PROMPTS
    ]
    requests = [GenerationRequest(list(prompts[i % len(prompts)]), params) for i in range(BATCH)]
    speed: dict[str, list[float]] = {name: [] for name in engines}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for name, engine in engines.items():
            started = time.perf_counter()
            outputs = engine.generate(requests)
            seconds = time.perf_counter() - started
            if repeat:
                speed[name].append(sum(len(o.token_ids) for o in outputs) / seconds)
    for engine in engines.values():
        engine.close()
    print(f"{'':22} {'refit s, median':>16} {'generated tokens/s, median':>28}")
    for name in engines:
        print(
            f"{name:22} {statistics.median(refit_s[name]):16.3f} "
            f"{statistics.median(speed[name]):28.1f}   (tokens/s: "
            f"{', '.join(f'{s:.1f}' for s in speed[name])})"
        )
    print(
        f"full refit (update_weights, {full_bytes / 2**20:.0f} MiB in the engine's dtypes): "
        f"{statistics.median(full_s):.3f} s median"
    )


def trainer_part(args: argparse.Namespace) -> None:
    policy = validate_config(compose_raw([])).policy
    model, tokenizer = build_policy(policy, seed=0)
    lora = LoraConfig(enabled=args.mode == "lora")
    trainer = TorchPolicyTrainer(
        model,
        TorchTrainerConfig(lora=lora, optimizer=TorchOptimizerConfig(lr=1e-6)),
        LossConfig(kl_coef=0.0),
        temperature=1.0,
        pad_token_id=pad_token_id(tokenizer),
        keep_last_checkpoints=1,
        compute_dtype="auto",
    )
    batch = shared_prefix_episodes(4, 4, torch.Generator().manual_seed(0))
    advantages = torch.tensor([t.reward - 0.5 for t in batch])
    seconds = []
    for repeat in range(args.repeats + 1):
        started = time.perf_counter()
        trainer.train_step(batch, advantages)
        if repeat:
            seconds.append(time.perf_counter() - started)
    trained = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    moments = sum(
        t.numel() * t.element_size()
        for state in trainer.optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )
    if lora.enabled:
        moved = trainer.export_adapter().num_bytes
    else:
        # What the engine takes (body Linear weights rounded to bfloat16 where it computes so).
        engine = _engine(copy.deepcopy(model), "auto")
        dtypes = engine.weight_dtypes()
        moved = sum(t.numel() * dtypes[name].itemsize for name, t in model.state_dict().items())
        engine.close()
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    gradients = sum(p.numel() * p.element_size() for p in trained)
    print(
        f"{args.mode}: {statistics.median(seconds):.2f} s/step (steps: "
        f"{', '.join(f'{s:.2f}' for s in seconds)}), {sum(p.numel() for p in trained):,} "
        f"parameters trained, gradients {gradients / 2**20:.1f} MiB, "
        f"AdamW moments {moments / 2**20:.1f} MiB, refit {moved / 2**20:.1f} MiB, "
        f"peak resident {peak_gib:.2f} GiB, torch threads {torch.get_num_threads()}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("part", choices=("engine", "trainer"))
    parser.add_argument("--mode", choices=("full", "lora"), default="lora", help="trainer part")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    (engine_part if args.part == "engine" else trainer_part)(args)


if __name__ == "__main__":
    main()

"""The Megatron trainer against the torch trainer on the same batch, on this CPU: seconds per
`train_step` and each trainer's peak resident memory.

Both train SmolLM2-135M-Instruct in fp32 on the batch of `bench_trainer.py --batch random`
(`--episodes` of 300-600 tokens, the last quarter generated; 8 by default) in micro-batches of 2,
with the same loss and learning rate:
the torch trainer (`gymrl.trainer.torch_trainer`, packing off) and the Megatron trainer
(`gymrl.trainer.megatron`, TP 1, one rank over gloo, Megatron's local layers) through the CPU
device shim (`cpu_standins/megatron_trainer/megatron_on_cpu.py`; megatron-core needs
CUDA where no config reaches). Each trainer lives in a process of its own, so each peak is its
own; the steps alternate between the two after one warm-up step each, so a busy machine slows
both alike.

Runs in the Megatron venv (`make megatron-venv`):

    .venv-megatron/bin/python benchmarks/bench_megatron_trainer.py --threads 1 --steps 3

`--pair lora` sets the Megatron trainer training every weight against the same trainer training
the default LoRA adapter (`trainer.lora`, rank 16 on every Linear, through megatron-bridge), and
reports each one's trained parameters, gradient buffer bytes and optimizer state bytes (Adam's
moments and step; the distributed optimizer's master copies where it keeps any) as well:

    .venv-megatron/bin/python benchmarks/bench_megatron_trainer.py --pair lora --threads 1 --steps 3

Mind the memory: at 16 episodes in micro-batches of 4 each trainer passed 8 GB.
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_trainer import random_episodes

REPO = Path(__file__).resolve().parents[1]
MICRO_BATCH_SIZE = 2
LR = 1e-6


def _config(trainer: str):
    """`torch`, `megatron` (every weight) or `megatron_lora` (the default adapter)."""
    from gymrl.config.compose import compose_raw
    from gymrl.config.schema.policy import PolicyConfig
    from gymrl.model.loading import ensure_smollm2_checkpoint
    from gymrl.preflight.validate import validate_config

    folder = ensure_smollm2_checkpoint(PolicyConfig.model_fields["model_cache_dir"].default)
    common = [
        "policy.source=pretrained",
        f"++policy.path={folder}",
        "policy.dtype=float32",
        f"trainer.micro_batch_size={MICRO_BATCH_SIZE}",
        f"trainer.optimizer.lr={LR}",
        "loss.kl_coef=0.0",
    ]
    if trainer == "torch":
        return validate_config(compose_raw([*common, "trainer.prefix_packing=false"]))
    # LoRA refits the torch engine (SGLang's adapter refit is not wired): the engine on the CPU.
    generation = (
        ["trainer.lora.enabled=true", "generation.device=cpu", "cluster.gpus_per_node=1"]
        if trainer == "megatron_lora"
        else ["generation=sglang", "generation.num_engines=1", "cluster.gpus_per_node=2"]
    )
    return validate_config(
        compose_raw(
            [
                *common,
                "trainer=megatron",
                *generation,
                "generation.server.max_tokens_per_turn=1024",
                "trainer.activation_checkpointing=false",
                "trainer.sequence_parallel=false",
                "trainer.transformer_impl=local",
            ]
        )
    )


def _build(trainer: str):
    """The trainer of `trainer`'s kind, in this process."""
    config = _config(trainer)
    folder = str(config.policy.path)
    if trainer == "torch":
        from transformers import AutoModelForCausalLM

        from gymrl.config.schema.trainer import TorchTrainerConfig
        from gymrl.model.loading import load_tokenizer
        from gymrl.model.tokens import pad_token_id
        from gymrl.trainer.torch_trainer import TorchPolicyTrainer

        assert isinstance(config.trainer, TorchTrainerConfig)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        return TorchPolicyTrainer(
            model,
            config.trainer,
            config.loss,
            temperature=1.0,
            pad_token_id=pad_token_id(load_tokenizer(folder)),
            keep_last_checkpoints=1,
            compute_dtype="float32",
        )
    import os

    sys.path.insert(0, str(REPO))  # the device shim is a test helper
    from cpu_standins.megatron_trainer import megatron_on_cpu
    from gymrl.trainer.megatron.distributed import distributed_env
    from gymrl.trainer.megatron.worker import MegatronPolicyTrainer
    from nemo_gym_ext.ports import free_port

    megatron_on_cpu.prepare_process()
    os.environ.update(distributed_env(0, 1, "127.0.0.1", free_port()))
    return MegatronPolicyTrainer(config, temperature=1.0)


def _state_bytes(instance) -> dict[str, int]:
    """A Megatron trainer's trained parameters, DDP gradient buffer bytes and optimizer state
    bytes, once a step has made the state: Adam's moments and step, plus the distributed
    optimizer's parameter shards where they are a copy (the float32 master weights under
    bfloat16; in float32 they are views of the weights' own buffer, no extra memory)."""
    optimizer = instance._optimizer
    inner = [chained.optimizer for chained in getattr(optimizer, "chained_optimizers", [optimizer])]
    weights = {
        buffer.param_data.untyped_storage().data_ptr()
        for chunk in instance._model
        for buffer in chunk.buffers + chunk.expert_parallel_buffers
    }
    moments = sum(
        tensor.numel() * tensor.element_size()
        for adam in inner
        for per_param in adam.state.values()
        for tensor in per_param.values()
        if isinstance(tensor, torch.Tensor)
    )
    masters = sum(
        param.numel() * param.element_size()
        for adam in inner
        for group in adam.param_groups
        for param in group["params"]
        if param.untyped_storage().data_ptr() not in weights
    )
    grads = sum(
        buffer.grad_data.numel() * buffer.grad_data.element_size()
        for chunk in instance._model
        for buffer in chunk.buffers + chunk.expert_parallel_buffers
    )
    trained = sum(
        param.numel()
        for chunk in instance._model
        for param in chunk.parameters()
        if param.requires_grad
    )
    return {"trained": trained, "grad_buffer": grads, "moments": moments, "masters": masters}


def _serve(trainer: str, threads: int, episodes: int, pipe) -> None:
    """Child: build the trainer, then one timed step per message; answer "peak" with ru_maxrss
    and, for a Megatron trainer, its state's sizes."""
    torch.set_num_threads(threads)
    instance = _build(trainer)
    batch = random_episodes(episodes, torch.Generator().manual_seed(0))
    advantages = torch.tensor([t.reward - 0.5 for t in batch])
    pipe.send("ready")
    while pipe.recv() == "step":
        started = time.perf_counter()
        metrics = instance.train_step(batch, advantages)
        pipe.send((time.perf_counter() - started, metrics["loss"]))
    sizes = _state_bytes(instance) if trainer != "torch" else {}
    pipe.send((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, sizes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per trainer")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per trainer")
    parser.add_argument("--episodes", type=int, default=8, help="episodes per batch")
    parser.add_argument(
        "--pair",
        choices=("torch", "lora"),
        default="torch",
        help="torch: the torch trainer against Megatron's; lora: Megatron training every "
        "weight against Megatron training the default LoRA adapter",
    )
    args = parser.parse_args()
    spawn = multiprocessing.get_context("spawn")
    pipes = {}
    pair = ("torch", "megatron") if args.pair == "torch" else ("megatron", "megatron_lora")
    for trainer in pair:
        ours, theirs = spawn.Pipe()
        spawn.Process(
            target=_serve, args=(trainer, args.threads, args.episodes, theirs), daemon=True
        ).start()
        pipes[trainer] = ours
    for pipe in pipes.values():
        if not pipe.poll(900) or pipe.recv() != "ready":
            raise RuntimeError("a trainer did not start within 15 minutes")
    seconds: dict[str, list[float]] = {trainer: [] for trainer in pipes}
    losses: dict[str, list[float]] = {trainer: [] for trainer in pipes}
    for step in range(args.steps + 1):  # the first round warms up
        for trainer, pipe in pipes.items():
            pipe.send("step")
            elapsed, loss = pipe.recv()
            print(f"step {step} {trainer}: {elapsed:.2f} s, loss {loss:.5f}", flush=True)
            losses[trainer].append(loss)
            if step:
                seconds[trainer].append(elapsed)
    batch = random_episodes(args.episodes, torch.Generator().manual_seed(0))
    tokens = sum(len(t.token_ids) for t in batch)
    print(
        f"SmolLM2-135M fp32, {len(batch)} episodes, {tokens} tokens/step, "
        f"{args.threads} thread(s) per trainer"
    )
    for trainer, pipe in pipes.items():
        pipe.send("peak")
        peak, sizes = pipe.recv()
        median = statistics.median(seconds[trainer])
        print(
            f"  {trainer:>13}: {median:6.2f} s/step (steps: "
            f"{', '.join(f'{t:.2f}' for t in seconds[trainer])}), peak resident {peak:.2f} GiB, "
            f"losses {', '.join(f'{loss:.5f}' for loss in losses[trainer])}"
        )
        if sizes:
            print(
                f"  {'':>13}  {sizes['trained']:,} parameters trained, gradient buffer "
                f"{sizes['grad_buffer'] / 2**20:.1f} MiB, Adam state "
                f"{sizes['moments'] / 2**20:.1f} MiB, master copies "
                f"{sizes['masters'] / 2**20:.1f} MiB"
            )


if __name__ == "__main__":
    main()

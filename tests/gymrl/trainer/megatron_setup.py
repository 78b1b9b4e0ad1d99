"""What the real-Megatron tests share: the device, the tiny model's config, a fixed batch."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from gymrl.algo.trajectory import Trajectory
from gymrl.config.compose import compose_raw
from gymrl.config.schema.recipe import RecipeConfig
from gymrl.preflight.validate import validate_config
from gymrl.trainer.megatron.distributed import distributed_env
from nemo_gym_ext.ports import free_port

# CUDA where there is one; else the CPU through megatron_on_cpu.py.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# A machine without Transformer Engine trains with Megatron's local layers.
TRANSFORMER_IMPL = (
    "transformer_engine" if importlib.util.find_spec("transformer_engine") else "local"
)


def tiny_config(
    folder: Path, *, tp: int = 1, ranks: int = 1, lora: Sequence[str] = ()
) -> RecipeConfig:
    """The tiny policy at `folder`, trained by Megatron on `ranks` ranks at TP `tp`, in fp32;
    `lora`: `trainer.lora` overrides, which train an adapter refitted into the torch engine."""
    pretrained = ["policy.source=pretrained", f"++policy.path={folder}"]
    if not lora:
        return megatron_run_config(pretrained, tp=tp, ranks=ranks)
    return megatron_run_config(
        [*pretrained, "trainer.lora.enabled=true", *lora], tp=tp, ranks=ranks, generation="torch"
    )


def megatron_run_config(
    policy: Sequence[str],
    *,
    tp: int = 1,
    ep: int = 1,
    ranks: int = 1,
    generation: str = "sglang",
) -> RecipeConfig:
    """The policy of the overrides `policy`, trained by Megatron on `ranks` ranks at TP `tp` and
    EP `ep`, in fp32.

    Megatron trains next to SGLang engines (torch generation refits from Megatron only with
    LoRA, `generation=torch`): the config has one engine GPU besides the trainer's, and the
    tests build only the trainer.
    """
    engines = ["generation.num_engines=1"] if generation == "sglang" else []
    raw = compose_raw(
        [
            "trainer=megatron",
            f"generation={generation}",
            *engines,
            "generation.server.max_tokens_per_turn=256",
            *policy,
            "policy.dtype=float32",
            f"cluster.gpus_per_node={ranks + 1}",
            f"trainer.tensor_model_parallel_size={tp}",
            f"trainer.expert_model_parallel_size={ep}",
            "trainer.sequence_parallel=false",
            "trainer.activation_checkpointing=false",
            "trainer.micro_batch_size=2",
            "loss.kl_coef=0.0",
            "trainer.optimizer.lr=1e-3",
            f"trainer.transformer_impl={TRANSFORMER_IMPL}",
        ]
    )
    return validate_config(raw)


def megatron_batch(vocab: int, count: int = 5) -> tuple[list[Trajectory], torch.Tensor]:
    """`count` trajectories of random tokens (3-9 prompt, 1-9 generated) and their advantages."""
    generator = random.Random(0)
    trajectories = []
    for index in range(count):
        prompt, generated = generator.randint(3, 9), generator.randint(1, 9)
        tokens = [generator.randrange(1, vocab) for _ in range(prompt + generated)]
        trajectories.append(
            Trajectory(
                token_ids=tokens,
                loss_mask=[0] * prompt + [1] * generated,
                generation_logprobs=[0.0] * prompt + [-3.0] * generated,
                reward=float(index % 2),
                agent="a",
                group_id="g",
                weight_version=0,
            )
        )
    return trajectories, torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0][:count])


def exported_gradients(trainer: Any) -> dict[str, torch.Tensor]:
    """The gradients of the last step under Hugging Face names, gathered over TP like the weights
    (collective): each parameter's Megatron gradient (`main_grad`, clipped as the optimizer saw
    it) stands in for its data while Bridge exports, so the same name mapping and TP gathers
    apply."""
    params = [param for chunk in trainer._model for param in chunk.parameters()]
    data = [param.data for param in params]
    for param in params:
        param.data = param.main_grad.to(param.dtype)
    try:
        return trainer.export_weights()
    finally:
        for param, saved in zip(params, data, strict=True):
            param.data = saved


def join_as_rank(rank: int, world_size: int, port: int) -> None:
    """Make this spawned process rank `rank` of `world_size` on this machine, before its trainer
    is built: the CPU device shim (a no-op where CUDA is), its GPU, one thread, the rendezvous
    environment at `port`."""
    import os

    from cpu_standins.megatron_trainer import megatron_on_cpu
    from gymrl.trainer.megatron.distributed import distributed_env

    megatron_on_cpu.prepare_process()
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
    torch.set_num_threads(1)
    os.environ.update(distributed_env(rank, world_size, "127.0.0.1", port))
    os.environ["LOCAL_RANK"] = str(rank)  # all ranks on this machine


def tensor_parallel_run(
    rank: int, world_size: int, tp: int, folder: str, port: int, out: str
) -> None:
    """One rank of a run at TP `tp` over `world_size` ranks (a `torch.multiprocessing.spawn`
    target): log-probabilities of the fixed batch, one train step, its gradients and the weights
    after it; rank 0 saves them to `out`."""
    from gymrl.trainer.megatron.worker import MegatronPolicyTrainer

    join_as_rank(rank, world_size, port)
    config = tiny_config(Path(folder), tp=tp, ranks=world_size)
    trainer = MegatronPolicyTrainer(config, temperature=0.8)
    trajectories, advantages = megatron_batch(trainer._vocab_size)
    logprobs = trainer.compute_logprobs(trajectories)
    metrics = trainer.train_step(trajectories, advantages)
    gradients = exported_gradients(trainer)
    weights = trainer.export_weights()
    if rank == 0:
        torch.save(
            {"logprobs": logprobs, "metrics": metrics, "gradients": gradients, "weights": weights},
            out,
        )
    torch.distributed.destroy_process_group()


def tensor_parallel_lora_run(
    rank: int, world_size: int, folder: str, lora: list[str], port: int, out: str
) -> None:
    """One rank of a LoRA run at TP `world_size` (`lora`: `trainer.lora` overrides): two train
    steps, then the log-probabilities of the fixed batch and the exported adapter; rank 0 saves
    them (the adapter as its config and tensors) to `out`."""
    from gymrl.trainer.megatron.worker import MegatronPolicyTrainer

    join_as_rank(rank, world_size, port)
    config = tiny_config(Path(folder), tp=world_size, ranks=world_size, lora=lora)
    trainer = MegatronPolicyTrainer(config, temperature=0.8)
    trajectories, advantages = megatron_batch(trainer._vocab_size)
    for _ in range(2):
        trainer.train_step(trajectories, advantages)
    logprobs = trainer.compute_logprobs(trajectories)
    adapter = trainer.export_adapter()
    if rank == 0:
        torch.save(
            {"logprobs": logprobs, "config": adapter.config, "tensors": adapter.tensors}, out
        )
    torch.distributed.destroy_process_group()


@contextlib.contextmanager
def in_process_rank() -> Iterator[None]:
    """This process as rank 0 of 1 for a trainer built in it: the distributed env set, and on
    exit restored and Megatron's parallel groups destroyed (the next module's trainer sets them
    up again, which Megatron refuses while these exist)."""
    env = distributed_env(0, 1, "127.0.0.1", free_port())
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

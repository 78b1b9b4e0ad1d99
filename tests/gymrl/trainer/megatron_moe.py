"""The tiny Qwen3-MoE (`policy=tiny_qwen3_moe`) trained by the real Megatron trainer with expert
parallelism, each run in processes of its own (`torch.multiprocessing.spawn` targets, one per
rank, over gloo on the CPU through `megatron_on_cpu.py`): what the tests of
`test_megatron_moe.py` compare."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from gymrl.config.schema.recipe import RecipeConfig


def moe_config(*, ep: int, ranks: int) -> RecipeConfig:
    """`policy=tiny_qwen3_moe` trained on `ranks` ranks at expert parallelism `ep`, in fp32."""
    from tests.gymrl.trainer.megatron_setup import megatron_run_config

    return megatron_run_config(["policy=tiny_qwen3_moe"], ep=ep, ranks=ranks)


def _start_rank(
    rank: int,
    world_size: int,
    port: int,
    *,
    ep: int,
    temperature: float,
    config: RecipeConfig | None = None,
) -> Any:
    """This process as rank `rank` of `world_size`: the CPU shim, the rendezvous, the trainer
    (of `config`, else :func:`moe_config`'s)."""
    from gymrl.trainer.megatron.worker import MegatronPolicyTrainer
    from tests.gymrl.trainer.megatron_setup import join_as_rank

    join_as_rank(rank, world_size, port)
    config = config or moe_config(ep=ep, ranks=world_size)
    return MegatronPolicyTrainer(config, temperature=temperature)


def _everyones(mine: Any) -> list[Any]:
    """`mine` of every rank, in rank order (collective)."""
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    return gathered


def _step(trainer: Any, trajectories: Any, advantages: torch.Tensor) -> dict[str, float]:
    """One train step on every rank; its metrics merged over the ranks as the trainer group
    merges them."""
    from gymrl.trainer.megatron.group import merge_step_metrics

    return merge_step_metrics(_everyones(trainer.train_step(trajectories, advantages)))


def expert_parallel_run(
    rank: int, world_size: int, ep: int, port: int, out: str, checkpoints: str | None
) -> None:
    """One rank of a run at EP `ep`: the log-probabilities of the fixed batch (every rank's rows),
    the export before any step, one train step, the weights after it; with `checkpoints`, also
    the Hugging Face checkpoint of those weights and a save and resume (save, step, step again,
    load, step). Rank 0 saves it all to `out`."""
    from tests.gymrl.trainer.megatron_setup import megatron_batch

    trainer = _start_rank(rank, world_size, port, ep=ep, temperature=0.8)
    experts = sum(
        param.numel()
        for chunk in trainer._model
        for name, param in chunk.named_parameters()
        if ".experts." in name
    )
    trajectories, advantages = megatron_batch(trainer._vocab_size)
    logprobs: dict[int, list[float]] = {}
    for part in _everyones(trainer.compute_logprobs(trajectories)):
        logprobs |= part
    seen: dict[str, Any] = {
        "expert_parameters": _everyones(experts),
        "logprobs": logprobs,
        "exported": trainer.export_weights(),
    }
    start = time.perf_counter()
    seen["metrics"] = _step(trainer, trajectories, advantages)
    seen["step_seconds"] = time.perf_counter() - start
    seen["weights"] = trainer.export_weights()
    if checkpoints is not None:
        # What a disk refit (`generation.refit.transport: disk`) loads into SGLang.
        seen["hf_checkpoint"] = trainer.export_hf_checkpoint(Path(checkpoints).parent / "hf")
        saved_at = trainer.weight_version
        checkpoint = trainer.save_checkpoint(checkpoints, 1, {"position": 7})
        seen["saved"] = trainer.export_weights()
        seen["uninterrupted"] = _step(trainer, trajectories, advantages)
        seen["expected"] = trainer.export_weights()
        _step(trainer, trajectories, advantages)
        seen["resume_info"] = trainer.load_checkpoint(checkpoint)
        seen["versions"] = (saved_at, trainer.weight_version)
        seen["restored"] = trainer.export_weights()
        seen["resumed"] = _step(trainer, trajectories, advantages)
        seen["resumed_weights"] = trainer.export_weights()
        seen["checkpoint_files"] = sorted(
            str(path.relative_to(checkpoint)) for path in Path(checkpoint).rglob("*.distcp")
        )
    if rank == 0:
        torch.save(seen, out)
    torch.distributed.destroy_process_group()


ATTENTION_LORA = [
    "trainer.lora.enabled=true",
    "trainer.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]",
    "trainer.lora.rank=4",
    "trainer.lora.alpha=8",
    "trainer.optimizer.lr=1e-2",
]


def expert_parallel_lora_run(rank: int, world_size: int, port: int, out: str) -> None:
    """One rank of an attention-only LoRA run at EP `world_size` (an MoE's experts are refused
    as LoRA targets): two train steps, then the log-probabilities of the fixed batch (every
    rank's rows) and the exported adapter (its config and tensors). Rank 0 saves them to
    `out`."""
    from tests.gymrl.trainer.megatron_setup import megatron_batch, megatron_run_config

    config = megatron_run_config(
        ["policy=tiny_qwen3_moe", *ATTENTION_LORA],
        ep=world_size,
        ranks=world_size,
        generation="torch",
    )
    trainer = _start_rank(rank, world_size, port, ep=world_size, temperature=0.8, config=config)
    trajectories, advantages = megatron_batch(trainer._vocab_size)
    for _ in range(2):
        _step(trainer, trajectories, advantages)
    logprobs: dict[int, list[float]] = {}
    for part in _everyones(trainer.compute_logprobs(trajectories)):
        logprobs |= part
    adapter = trainer.export_adapter()
    if rank == 0:
        torch.save(
            {"logprobs": logprobs, "config": adapter.config, "tensors": adapter.tensors}, out
        )
    torch.distributed.destroy_process_group()


def expert_parallel_refit_run(
    rank: int, world_size: int, url: str, prompt: list[int], port: int, out: str
) -> None:
    """One rank of the trainer at EP `world_size` refitting the SGLang server at `url` by
    broadcast, with the weight check on (`generation.refit.verify_weights`, method
    `weights_checker`): the first refit resends the weights the server started from (version
    0), so the server snapshots its weights, randomises them, takes the refit and compares; then
    one train step and the refit of version 1. Rank 0 drives the server and saves to `out` what
    it saw: greedy answers, seconds and bytes of each refit, the names sent."""
    from gymrl.generation.sglang.engine import SGLangEngine
    from gymrl.generation.sglang.refit_checks.weights_checker import checker_for
    from gymrl.generation.types import GenerationRequest, SamplingParams
    from gymrl.model.policy import model_folder
    from gymrl.model.tokens import model_end_token_ids
    from tests.gymrl.trainer.megatron_refit import GREEDY_TOKENS, TIMEOUT_S, _away_from, _generate
    from tests.support.real_sglang import cpu_generation

    trainer = _start_rank(rank, world_size, port, ep=world_size, temperature=1.0)
    refit = cpu_generation().refit.model_copy(update={"verify_weights": True})
    assert refit.verify_method == "weights_checker"
    request = GenerationRequest(
        prompt, SamplingParams(max_new_tokens=GREEDY_TOKENS, temperature=0.0)
    )
    seen: dict[str, Any] = {}
    engine = None
    if rank == 0:
        engine = SGLangEngine(
            [url],
            request_timeout_s=TIMEOUT_S,
            refit_timeout_s=TIMEOUT_S,
            weight_version=0,
            end_token_ids=model_end_token_ids(model_folder(trainer._config.policy)),
            weights_checker=checker_for(refit),
        )
        seen["loaded"] = _generate(engine, request)

    def refit_to(version: int) -> tuple[float, int]:
        start = time.perf_counter()
        if engine is not None:
            engine.begin_refit(version)
        sent = trainer.send_weights([url], [1], refit, version)
        if engine is not None:
            engine.end_refit(version)
        return time.perf_counter() - start, sent

    seen["seconds"], seen["bytes"] = refit_to(0)
    if engine is not None:
        seen["unchanged"] = _generate(engine, request)
    loaded = _everyones(seen.get("loaded"))[0]  # rank 0's answer, the batch of every rank
    trajectories, advantages = _away_from(prompt, loaded)
    seen["metrics"] = _step(trainer, trajectories, advantages)
    seen["trained_seconds"], sent = refit_to(1)
    seen["trained_bytes"] = sent - seen["bytes"]
    if engine is not None:
        seen["trained"] = _generate(engine, request)
        engine.close()
    seen["sent_names"] = sorted(trainer.export_weights())
    if rank == 0:
        torch.save(seen, out)
    torch.distributed.destroy_process_group()


def router_replay_run(rank: int, world_size: int, port: int, routes_path: str, out: str) -> None:
    """One rank of the trainer at EP `world_size` with router replay on: the log-probabilities
    of the fixed batch with the routers' own choices, with the routes in `routes_path` (one
    `[tokens, layers, top-k]` uint8 array per trajectory, the missing id where none), with
    every route moved to the next expert, and with no route at all; then one train step on the
    moved routes, and the routers' weights before and after it. Rank 0 saves it all to `out`."""
    import dataclasses

    import numpy as np

    from tests.gymrl.trainer.megatron_setup import megatron_batch

    config = megatron_run_config_r3(ep=world_size, ranks=world_size)
    trainer = _start_rank(rank, world_size, port, ep=world_size, temperature=0.8, config=config)
    trajectories, advantages = megatron_batch(trainer._vocab_size)
    routes = torch.load(routes_path, weights_only=False)
    experts = config.policy.tiny_moe.num_experts

    def with_routes(chosen: list[Any]) -> list[Any]:
        return [
            dataclasses.replace(t, routed_experts=r)
            for t, r in zip(trajectories, chosen, strict=True)
        ]

    def logprobs(batch: list[Any]) -> dict[int, list[float]]:
        found: dict[int, list[float]] = {}
        for part in _everyones(trainer.compute_logprobs(batch)):
            found |= part
        return found

    moved = [
        np.where(r == np.iinfo(r.dtype).max, r, (r.astype(np.int64) + 1) % experts).astype(r.dtype)
        for r in routes
    ]
    missing = [np.full_like(r, np.iinfo(r.dtype).max) for r in routes]

    def routers() -> dict[str, torch.Tensor]:
        return {k: v for k, v in trainer.export_weights().items() if k.endswith("mlp.gate.weight")}

    seen: dict[str, Any] = {
        "routers": len(trainer._route_replays),
        "loss_masks": [t.loss_mask for t in trajectories],
        "live": logprobs(trajectories),
        "replayed": logprobs(with_routes(routes)),
        "moved": logprobs(with_routes(moved)),
        "missing": logprobs(with_routes(missing)),
        "routers_before": routers(),
    }
    seen["metrics"] = _step(trainer, with_routes(moved), advantages)
    seen["routers_after"] = routers()
    seen["cleared"] = all(replay.target is None for replay in trainer._route_replays)
    if rank == 0:
        torch.save(seen, out)
    torch.distributed.destroy_process_group()


def megatron_run_config_r3(*, ep: int, ranks: int) -> RecipeConfig:
    """:func:`moe_config` with router replay on."""
    from tests.gymrl.trainer.megatron_setup import megatron_run_config

    return megatron_run_config(
        ["policy=tiny_qwen3_moe", "policy.router_replay.enabled=true"], ep=ep, ranks=ranks
    )

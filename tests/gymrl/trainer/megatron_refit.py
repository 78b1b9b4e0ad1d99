"""A refit from the Megatron trainer into a real SGLang server, in a process of its own.

The trainer (one rank, over gloo on the CPU through `megatron_on_cpu.py`) and the server hold
the same checkpoint. The run randomises the server's weights (`/weights_checker` reset_tensors),
refits the trainer's unchanged weights by broadcast (`MegatronPolicyTrainer.send_weights`, the
path `generation.refit.transport: nccl` takes), takes one train step and refits again; it records
the server's greedy output, its weight checksums and the refit's seconds and bytes at each point.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import torch

from gymrl.algo.trajectory import Trajectory
from gymrl.generation.sglang.engine import SGLangEngine
from gymrl.generation.types import GenerationRequest, SamplingParams
from gymrl.model.tokens import model_end_token_ids
from tests.support.real_sglang import cpu_generation

GREEDY_TOKENS = 12
TIMEOUT_S = 120.0


def _checksum(client: httpx.Client, url: str) -> str:
    answer = client.post(f"{url}/weights_checker", json={"action": "checksum"})
    answer.raise_for_status()
    return answer.json()["per_engine_checksum"]


def _refit(trainer: Any, engine: SGLangEngine, url: str, version: int) -> tuple[float, int]:
    """One broadcast refit as `gymrl.generation.sglang.refit.refit_by_broadcast` runs it: seconds
    from
    the pause to the resume, and the bytes the trainer has sent so far."""
    start = time.perf_counter()
    engine.begin_refit(version)
    sent = trainer.send_weights([url], [1], cpu_generation().refit, version)
    engine.end_refit(version)
    return time.perf_counter() - start, sent


def refit_run(rank: int, folder: str, url: str, prompt: list[int], port: int, out: str) -> None:
    """Rank 0 of the trainer (a `multiprocessing` spawn target); saves what it saw to `out`."""
    from gymrl.trainer.megatron.worker import MegatronPolicyTrainer
    from tests.gymrl.trainer.megatron_setup import join_as_rank, tiny_config

    join_as_rank(rank, 1, port)
    trainer = MegatronPolicyTrainer(tiny_config(Path(folder)), temperature=1.0)
    request = GenerationRequest(
        prompt, SamplingParams(max_new_tokens=GREEDY_TOKENS, temperature=0.0)
    )
    seen: dict[str, Any] = {}
    engine = SGLangEngine(
        [url],
        request_timeout_s=TIMEOUT_S,
        refit_timeout_s=TIMEOUT_S,
        weight_version=0,
        end_token_ids=model_end_token_ids(folder),
    )
    with engine, httpx.Client(timeout=TIMEOUT_S) as client:
        seen["loaded"] = _generate(engine, request)
        seen["checksum_loaded"] = _checksum(client, url)
        reset = client.post(f"{url}/weights_checker", json={"action": "reset_tensors"})
        reset.raise_for_status()
        seen["checksum_randomised"] = _checksum(client, url)
        seen["seconds"], seen["bytes"] = _refit(trainer, engine, url, 1)
        seen["checksum_refit"] = _checksum(client, url)
        seen["unchanged"] = _generate(engine, request)
        trajectories, advantages = _away_from(prompt, seen["loaded"])
        seen["metrics"] = trainer.train_step(trajectories, advantages)
        seen["trained_seconds"], sent = _refit(trainer, engine, url, 2)
        seen["trained_bytes"] = sent - seen["bytes"]
        seen["checksum_trained"] = _checksum(client, url)
        seen["trained"] = _generate(engine, request)
    seen["sent_names"] = sorted(trainer.export_weights())
    torch.save(seen, out)
    torch.distributed.destroy_process_group()


def _away_from(prompt: list[int], served: dict[str, Any]) -> tuple[list[Trajectory], torch.Tensor]:
    """A GRPO group of two: the server's greedy answer, penalised (advantage -1), and the prompt's
    own first token repeated as long, rewarded (+1); on-policy, as the server sampled them. A
    step on random tokens moves every weight but leaves a random model's greedy answer as it
    was; this one is the step that changes it."""
    answer = served["token_ids"]
    other = [prompt[0]] * len(answer)
    trajectories = [
        Trajectory(
            token_ids=prompt + tokens,
            loss_mask=[0] * len(prompt) + [1] * len(tokens),
            generation_logprobs=[0.0] * len(prompt) + logprobs,
            reward=reward,
            agent="a",
            group_id="g",
            weight_version=1,
        )
        for tokens, logprobs, reward in (
            (answer, served["logprobs"], 0.0),
            (other, [-3.0] * len(other), 1.0),
        )
    ]
    return trajectories, torch.tensor([-1.0, 1.0])


def _generate(engine: SGLangEngine, request: GenerationRequest) -> dict[str, Any]:
    [output] = engine.generate([request])
    return {
        "token_ids": output.token_ids,
        "logprobs": output.logprobs,
        "weight_version": output.weight_version,
    }

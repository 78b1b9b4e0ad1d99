"""GRPO learns in the right direction: on a toy policy whose reward prefers one token, a few real
steps (sampling, group advantages, the GRPO loss, AdamW) raise that token's probability, also
when every batch was sampled by weights two steps old and only importance correction links them.

A sign error in the advantages, the loss or the ratio would lower the probability instead.
"""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gymrl.algo.advantages import grpo_advantages
from gymrl.algo.trajectory import Trajectory
from gymrl.config.schema import LossConfig, TorchOptimizerConfig, TorchTrainerConfig
from gymrl.model.precision import ComputeDtype
from gymrl.trainer.torch_trainer import TorchPolicyTrainer

PROMPT = [1, 2, 3]
TARGET = 7  # the token the reward prefers
GROUPS, GROUP_SIZE, STEPS = 4, 8, 8


def _toy_policy() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
        pad_token_id=0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _next_token_logprobs(model: LlamaForCausalLM) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT])).logits[0, -1]
    return torch.log_softmax(logits.float(), dim=-1)


def _sample_batch(sampler: LlamaForCausalLM, step: int, generator: torch.Generator):
    """GROUPS groups of GROUP_SIZE one-token episodes from `sampler`, with its log-probs."""
    logprobs = _next_token_logprobs(sampler)
    tokens = torch.multinomial(logprobs.exp(), GROUPS * GROUP_SIZE, True, generator=generator)
    trajectories = [
        Trajectory(
            token_ids=[*PROMPT, int(token)],
            loss_mask=[0] * len(PROMPT) + [1],
            generation_logprobs=[0.0] * len(PROMPT) + [float(logprobs[token])],
            reward=float(token == TARGET),
            agent="toy",
            group_id=f"{step}-{index // GROUP_SIZE}",
            weight_version=step,
        )
        for index, token in enumerate(tokens)
    ]
    rewards = torch.tensor([t.reward for t in trajectories])
    advantages = grpo_advantages(
        rewards, [t.group_id for t in trajectories], normalize_by_std=True, eps=1e-6
    )
    return trajectories, advantages


def _trainer(model: LlamaForCausalLM, compute_dtype: ComputeDtype) -> TorchPolicyTrainer:
    config = TorchTrainerConfig(
        micro_batch_size=GROUPS * GROUP_SIZE, optimizer=TorchOptimizerConfig(lr=3e-2)
    )
    return TorchPolicyTrainer(
        model,
        config,
        LossConfig(),
        temperature=1.0,
        pad_token_id=0,
        keep_last_checkpoints=1,
        compute_dtype=compute_dtype,
    )


# bfloat16: the body in mixed precision, as `policy.compute_dtype=auto` runs it on an AMX CPU.
@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lag", [0, 2], ids=["on-policy", "two-steps-stale"])
def test_grpo_steps_raise_the_rewarded_tokens_probability(lag, compute_dtype):
    model = _toy_policy()
    trainer = _trainer(model, compute_dtype)
    generator = torch.Generator().manual_seed(1)
    snapshots = [copy.deepcopy(model)]  # snapshots[k]: the weights after k steps
    start = float(_next_token_logprobs(model)[TARGET].exp())
    ratios = []
    for step in range(STEPS):
        sampler = snapshots[max(step - lag, 0)]
        trajectories, advantages = _sample_batch(sampler, step, generator)
        metrics = trainer.train_step(trajectories, advantages)
        ratios.append(metrics["importance_ratio/mean"])
        snapshots.append(copy.deepcopy(model))
    end = float(_next_token_logprobs(model)[TARGET].exp())
    assert start < 0.15  # the toy starts far from the answer
    assert end > 2 * start, (start, end)
    if lag:  # the correction really saw samples from other weights
        assert max(abs(ratio - 1.0) for ratio in ratios[lag:]) > 1e-3
    elif compute_dtype == "float32":  # on-policy samples are the trainer's own distribution
        assert all(ratio == pytest.approx(1.0, abs=1e-4) for ratio in ratios)
    else:  # only the body's bfloat16 rounding separates them
        assert all(ratio == pytest.approx(1.0, abs=2e-2) for ratio in ratios)

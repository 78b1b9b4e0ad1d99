"""GRPO learns in the right direction: on a toy policy whose reward prefers one token, a few real
steps (sampling, group advantages, the GRPO loss, AdamW) raise that token's probability, also
when every batch was sampled by weights two steps old and only importance correction links them.

A sign error in the advantages, the loss or the ratio would lower the probability instead. Each
off-policy correction mode is run on the stale batches too: a mask applied to the wrong tokens
(the in-band ones) leaves nothing to learn from, a cap applied the wrong way round lets stale
tokens dominate, and either fails the rise. The episode rules are run the same way: an overlong
mask that kept the overlong episodes, or a length penalty with the wrong sign, would teach the
policy to run into the limit.
"""

import copy

import pytest
import torch
from transformers import LlamaForCausalLM

from gymrl.algo.advantages import grpo_advantages
from gymrl.algo.episode_rules import EpisodeRules
from gymrl.algo.loss import finish_agent_statistics
from gymrl.algo.trajectory import Trajectory
from gymrl.config.schema.loss import EpisodeRulesConfig, LossConfig, OffPolicyCorrectionConfig
from gymrl.config.schema.trainer import TorchOptimizerConfig, TorchTrainerConfig
from gymrl.model.loading import build_tiny_llama
from gymrl.model.precision import ComputeDtype
from gymrl.trainer.torch_trainer import TorchPolicyTrainer

PROMPT = [1, 2, 3]
TARGET = 7  # the token the reward prefers
GROUPS, GROUP_SIZE, STEPS = 4, 8, 8


def _toy_policy() -> LlamaForCausalLM:
    return build_tiny_llama(
        16,
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        intermediate_size=64,
        seed=0,
        max_position_embeddings=16,
        pad_token_id=0,
    )


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


def _trainer(
    model: LlamaForCausalLM, compute_dtype: ComputeDtype, loss: LossConfig | None = None
) -> TorchPolicyTrainer:
    config = TorchTrainerConfig(
        micro_batch_size=GROUPS * GROUP_SIZE, optimizer=TorchOptimizerConfig(lr=3e-2)
    )
    return TorchPolicyTrainer(
        model,
        config,
        loss or LossConfig(),
        temperature=1.0,
        pad_token_id=0,
        keep_last_checkpoints=1,
        compute_dtype=compute_dtype,
    )


# bfloat16: the body in mixed precision, as `policy.compute_dtype=auto` runs it on an AMX CPU.
@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lag", [0, 2], ids=["on-policy", "two-steps-stale"])
def test_grpo_steps_raise_the_rewarded_tokens_probability(lag, compute_dtype):
    _assert_training_raises_the_target(lag, compute_dtype, LossConfig())


# One step stale, the async default (grpo.max_trajectory_age_steps=1), with the default band and
# cap. Two steps stale, this toy's large step moves the rewarded token's ratio past 1.6 within a
# step, so a mask mode removes exactly the tokens that teach and the probability falls for a
# while (measured: 0.059 -> 0.010 over 8 steps with a [0.8, 1.25] band): masks are for an engine
# that disagrees with the trainer, not for weights several large steps apart.
MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@pytest.mark.parametrize("mode", MODES)
def test_every_off_policy_mode_learns_from_stale_batches(mode):
    figures = _assert_training_raises_the_target(
        1, "float32", LossConfig(off_policy_correction=OffPolicyCorrectionConfig(mode=mode))
    )
    corrected = [f["toy"]["masked_share"] + f["toy"]["capped_share"] for f in figures]
    assert max(corrected) > 0.05  # the correction really acted on some tokens


def _assert_training_raises_the_target(lag, compute_dtype, loss):
    """Train STEPS steps on batches sampled `lag` steps behind; returns each step's per-agent
    trainer-engine figures."""
    model = _toy_policy()
    trainer = _trainer(model, compute_dtype, loss)
    generator = torch.Generator().manual_seed(1)
    snapshots = [copy.deepcopy(model)]  # snapshots[k]: the weights after k steps
    start = float(_next_token_logprobs(model)[TARGET].exp())
    ratios, figures = [], []
    for step in range(STEPS):
        sampler = snapshots[max(step - lag, 0)]
        trajectories, advantages = _sample_batch(sampler, step, generator)
        metrics = trainer.train_step(trajectories, advantages)
        ratios.append(metrics["importance_ratio/mean"])
        figures.append(finish_agent_statistics(metrics))
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
    return figures


# A token the reward likes as much as TARGET, but whose episode ran into the limit; the toy
# starts out preferring it (0.107 against 0.059), so without the rules LONG wins.
LONG = 3


@pytest.mark.parametrize(
    ("rules", "target_over_long"),
    [
        (EpisodeRulesConfig(overlong_penalty_buffer_tokens=4, overlong_penalty_max=1.0), 2.0),
        (EpisodeRulesConfig(overlong_mask=True), 1.0),
    ],
    ids=["soft-penalty", "overlong-mask"],
)
def test_overlong_rules_steer_the_policy_away_from_the_limit(rules, target_over_long):
    """TARGET and LONG earn the same reward, but a LONG episode's call ran to the token limit:
    with the soft penalty (its training reward drops to 0) or the overlong mask (it trains on
    nothing, its reward still in the baseline) the policy comes to prefer TARGET."""
    target, long = _train_with_overlong_rules(rules)
    assert target > target_over_long * long, (target, long)


def test_without_overlong_rules_the_toy_prefers_the_overlong_token():
    """The control that shows the test above can fail: with no rule, LONG (the likelier at the
    start) wins."""
    target, long = _train_with_overlong_rules(EpisodeRulesConfig())
    assert long > 2 * target, (target, long)


def _train_with_overlong_rules(rules: EpisodeRulesConfig) -> tuple[float, float]:
    """STEPS on-policy steps where TARGET and LONG are rewarded; (p(TARGET), p(LONG)) after."""
    model = _toy_policy()
    trainer = _trainer(model, "float32")
    shaping = EpisodeRules(LossConfig(episodes=rules), default_limit_tokens=8)
    generator = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        logprobs = _next_token_logprobs(model)
        tokens = torch.multinomial(logprobs.exp(), GROUPS * GROUP_SIZE, True, generator=generator)
        trajectories = [
            shaping.shape(
                Trajectory(
                    token_ids=[*PROMPT, int(token)],
                    loss_mask=[0] * len(PROMPT) + [1],
                    generation_logprobs=[0.0] * len(PROMPT) + [float(logprobs[token])],
                    reward=float(token in (TARGET, LONG)),
                    agent="toy",
                    group_id=f"{step}-{index // GROUP_SIZE}",
                    weight_version=step,
                    overlong=bool(token == LONG),
                    turn_lengths=(8 if token == LONG else 1,),
                )
            )
            for index, token in enumerate(tokens)
        ]
        if not any(t.num_generated_tokens for t in trajectories):
            continue
        trainer.train_step(trajectories, shaping.advantages(trajectories, {}))
    probabilities = _next_token_logprobs(model).exp()
    return float(probabilities[TARGET]), float(probabilities[LONG])

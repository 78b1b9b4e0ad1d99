"""The Megatron trainer's pure parts: config mapping, micro-batch planning, the context-parallel
layout and the loss scaling (the real Megatron: test_megatron_real.py)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gymrl.algo.loss import grpo_loss
from gymrl.cluster.placement import trainer_gpus
from gymrl.config.schema.loss import OffPolicyCorrectionConfig
from gymrl.config.schema.policy import RouterReplayConfig
from gymrl.config.schema.trainer import TorchTrainerConfig
from gymrl.trainer.capabilities import unsupported_by_trainer
from gymrl.trainer.grpo_step import loss_normalizer
from gymrl.trainer.megatron.arguments import (
    data_parallel_size,
    ddp_config_kwargs,
    megatron_loss_scale,
    optimizer_config_kwargs,
    parallel_state_kwargs,
    provider_overrides,
    scheduler_kwargs,
    sequence_multiple,
    unsupported_settings,
)
from gymrl.trainer.megatron.batches import (
    PAD_TOKEN_ID,
    MicroBatch,
    build_micro_batch,
    context_parallel_positions,
    context_parallel_unshard,
    plan_micro_batches,
)
from gymrl.trainer.megatron.distributed import distributed_env
from gymrl.trainer.megatron.worker import MegatronPolicyTrainer
from tests.gymrl.trainer.fixed_trajectories import fixed_trajectory


def _replace(config, **sections):
    """`config` with fields of its sub-configs replaced: `_replace(c, loss={"kl_coef": 0.1})`."""
    updates = {
        name: getattr(config, name).model_copy(update=fields) for name, fields in sections.items()
    }
    return config.model_copy(update=updates)


# ---------------------------------------------------------------------------- config mapping
def test_swe_bench_config_maps_to_megatron_arguments(swe_config):
    trainer = swe_config.trainer
    assert parallel_state_kwargs(trainer) == {
        "tensor_model_parallel_size": 4,
        "pipeline_model_parallel_size": 1,
        "virtual_pipeline_model_parallel_size": None,
        "context_parallel_size": 2,
        "expert_model_parallel_size": 8,
        "expert_tensor_parallel_size": 1,
    }
    provider = provider_overrides(swe_config)
    assert provider["sequence_parallel"] is True and provider["bf16"] is True
    assert provider["params_dtype"] is torch.bfloat16 is provider["pipeline_dtype"]
    assert provider["seq_length"] == 65536
    assert provider["recompute_granularity"] == "full"
    assert provider["calculate_per_token_loss"] is False
    assert provider["context_parallel_size"] == 2 and provider["expert_model_parallel_size"] == 8
    assert provider["transformer_impl"] == "transformer_engine"
    optimizer = optimizer_config_kwargs(swe_config)
    assert optimizer["optimizer"] == "adam" and optimizer["use_distributed_optimizer"]
    assert (optimizer["lr"], optimizer["weight_decay"], optimizer["clip_grad"]) == (1e-6, 0.01, 1.0)
    assert (optimizer["adam_beta1"], optimizer["adam_beta2"], optimizer["adam_eps"]) == (
        0.9,
        0.999,
        1e-8,
    )
    schedule = scheduler_kwargs(swe_config)
    assert schedule["lr_decay_style"] == "constant" == schedule["wd_incr_style"]
    assert schedule["max_lr"] == schedule["min_lr"] == 1e-6 and schedule["end_wd"] == 0.01
    assert ddp_config_kwargs(trainer)["average_in_collective"] is False
    assert sequence_multiple(trainer) == 16  # 2 x CP 2 x TP 4 under sequence parallelism
    assert data_parallel_size(trainer_gpus(swe_config), trainer) == 8
    assert unsupported_settings(swe_config) == []


def test_no_recomputation_without_activation_checkpointing(swe_config):
    config = _replace(swe_config, trainer={"activation_checkpointing": False})
    assert "recompute_granularity" not in provider_overrides(config)


def test_unsupported_settings_name_key_and_fix(swe_config):
    config = _replace(
        swe_config,
        loss={"kl_coef": 0.1},
        trainer={"transformer_impl": "local"},  # swe_bench_30b uses context parallelism
    )
    problems = unsupported_settings(config)
    assert any("loss.kl_coef = 0.1" in p and "set loss.kl_coef=0" in p for p in problems)
    assert any(
        "trainer.transformer_impl = 'local'" in p and "context_parallel_size=1" in p
        for p in problems
    )
    # Refused before Megatron is imported, so the CPU machine reports it too.
    with pytest.raises(ValueError, match=r"loss\.kl_coef"):
        MegatronPolicyTrainer(config, temperature=1.0)


@pytest.mark.parametrize(
    ("tp", "cp", "sp", "expected"),
    [(4, 1, False, 1), (4, 1, True, 4), (1, 2, False, 4), (4, 2, True, 16), (2, 4, False, 8)],
)
def test_sequence_multiple(swe_config, tp, cp, sp, expected):
    trainer = swe_config.trainer.model_copy(
        update={
            "tensor_model_parallel_size": tp,
            "context_parallel_size": cp,
            "sequence_parallel": sp,
        }
    )
    assert sequence_multiple(trainer) == expected


def test_data_parallel_size_rejects_a_partial_replica(swe_config):
    with pytest.raises(ValueError, match="not a multiple of TP x PP x CP = 8"):
        data_parallel_size(60, swe_config.trainer)


# --------------------------------------------------------------------------------- planning
@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 200), max_size=40),
    dp=st.integers(1, 4),
    mbs=st.integers(1, 3),
    multiple=st.sampled_from([1, 4, 16]),
    uniform=st.booleans(),
)
def test_plan_covers_each_trajectory_once_with_equal_counts(lengths, dp, mbs, multiple, uniform):
    plans = plan_micro_batches(
        lengths,
        data_parallel_size=dp,
        micro_batch_size=mbs,
        sequence_multiple=multiple,
        uniform_shapes=uniform,
    )
    assert len(plans) == dp
    assert len({len(plan) for plan in plans}) == 1  # every rank runs as many micro-batches
    placed = [i for plan in plans for mb in plan for i in mb.indices if i is not None]
    assert sorted(placed) == [i for i, n in enumerate(lengths) if n > 0]
    for plan in plans:
        for mb in plan:
            assert 1 <= len(mb.indices) <= mbs and mb.seq_length % multiple == 0
            assert all(mb.seq_length >= lengths[i] for i in mb.indices if i is not None)
            if uniform:
                assert len(mb.indices) == mbs
    if uniform:
        assert len({mb.seq_length for plan in plans for mb in plan}) == 1
    tokens = [sum(lengths[i] for mb in plan for i in mb.indices if i is not None) for plan in plans]
    assert max(tokens) - min(tokens) <= max(lengths, default=0)


def test_plan_groups_similar_lengths_and_pads_each_micro_batch():
    plans = plan_micro_batches(
        [10, 0, 7, 3, 12, 5, 8],
        data_parallel_size=2,
        micro_batch_size=2,
        sequence_multiple=4,
        uniform_shapes=False,
    )
    # Longest first, dealt in snake order: rank 0 gets 12, 7, 5 tokens; rank 1 gets 10, 8, 3.
    assert plans == [
        [MicroBatch((4, 2), 12), MicroBatch((5,), 8)],
        [MicroBatch((0, 6), 12), MicroBatch((3,), 4)],
    ]


def test_plan_of_masked_trajectories_is_one_filler_per_rank():
    plans = plan_micro_batches(
        [0, 0], data_parallel_size=2, micro_batch_size=4, sequence_multiple=8, uniform_shapes=False
    )
    assert plans == [[MicroBatch((None,), 8)], [MicroBatch((None,), 8)]]


def test_build_micro_batch_aligns_labels_fillers_and_advantages():
    trajectories = [fixed_trajectory(2, 3), fixed_trajectory(1, 1)]
    batch = build_micro_batch(
        trajectories, torch.tensor([0.5, -1.0]), MicroBatch((1, None, 0), seq_length=8)
    )
    assert batch["input_ids"].tolist() == [
        [1, 2] + [PAD_TOKEN_ID] * 6,
        [PAD_TOKEN_ID] * 8,
        [1, 2, 3, 4, 5] + [PAD_TOKEN_ID] * 3,
    ]
    assert batch["labels"][2].tolist() == [2, 3, 4, 5] + [PAD_TOKEN_ID] * 4
    assert batch["loss_mask"].tolist()[1] == [0] * 8  # the filler trains on nothing
    assert batch["loss_mask"][2].tolist() == [0, 0, 1, 1, 1, 0, 0, 0]
    assert batch["advantages"].tolist() == [-1.0, 0.0, 0.5]
    assert batch["position_ids"][1].tolist() == list(range(8))


# ---------------------------------------------------------------------- context parallelism
def test_context_parallel_layout_is_megatrons_load_balanced_split():
    assert context_parallel_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert context_parallel_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert context_parallel_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    with pytest.raises(ValueError, match="not a multiple of 2 x CP = 4"):
        context_parallel_positions(6, 2, 0)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_context_parallel_unshard_inverts_the_split(cp):
    full = torch.randn(3, 16)
    shards = [full[:, context_parallel_positions(16, cp, rank)] for rank in range(cp)]
    assert torch.equal(context_parallel_unshard(shards), full)


# --------------------------------------------------------------------------- loss and scale
@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize(("dp", "cp", "mbs"), [(1, 1, 1), (2, 1, 2), (2, 2, 1), (3, 2, 2)])
def test_megatron_reduction_of_scaled_losses_gives_the_full_batch_gradient(
    token_level, dp, cp, mbs
):
    """Emulates Megatron's reduction: a micro-batch loss divided by the number of micro-batches,
    gradients scaled by 1/DP and summed over DP x CP ranks; under CP each rank's loss is the
    whole-sequence loss whose gradient reaches only its own chunk, times CP (the backward of the
    all-gather sums every rank's gradient into each chunk)."""
    generator = random.Random(dp * 10 + cp + mbs)
    trajectories = [
        fixed_trajectory(generator.randint(1, 5), generator.randint(0, 6), group=str(i))
        for i in range(7)
    ]
    advantages = torch.tensor([generator.uniform(-1, 1) for _ in trajectories])
    multiple = 2 * cp if cp > 1 else 1
    logits_table = torch.randn(64, requires_grad=True)  # the "model": a logprob per token id

    def per_token(batch):
        return torch.log_softmax(logits_table, 0)[batch["input_ids"]]

    loss_kwargs = dict(
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        kl_coef=0.0,
        off_policy=OffPolicyCorrectionConfig(mode="token_truncate", ratio_high=2.0),
        token_level_normalization=token_level,
    )
    normalizer = loss_normalizer(trajectories, token_level)
    full = build_micro_batch(
        trajectories, advantages, MicroBatch(tuple(range(len(trajectories))), 16)
    )
    expected_loss, _ = grpo_loss(
        per_token(full),
        full["generation_logprobs"],
        full["advantages"],
        full["loss_mask"],
        normalizer=normalizer,
        **loss_kwargs,
    )
    (expected,) = torch.autograd.grad(expected_loss, logits_table)

    plans = plan_micro_batches(
        [len(t.token_ids) for t in trajectories],
        data_parallel_size=dp,
        micro_batch_size=mbs,
        sequence_multiple=multiple,
        uniform_shapes=False,
    )
    total = torch.zeros_like(logits_table)
    for plan in plans:
        scale = megatron_loss_scale(len(plan), dp, cp)
        for micro_batch in plan:
            batch = build_micro_batch(trajectories, advantages, micro_batch)
            for rank in range(cp):
                logprobs = per_token(batch)
                own = torch.zeros(batch["input_ids"].shape[1], dtype=torch.bool)
                own[context_parallel_positions(own.numel(), cp, rank)] = True
                # Same values; the gradient reaches only this rank's chunk, times CP.
                change = logprobs - logprobs.detach()
                routed = logprobs.detach() + torch.where(own, change * cp, torch.zeros_like(change))
                loss, _ = grpo_loss(
                    routed,
                    batch["generation_logprobs"],
                    batch["advantages"],
                    batch["loss_mask"],
                    normalizer=normalizer,
                    **loss_kwargs,
                )
                (grad,) = torch.autograd.grad(loss * scale / len(plan), logits_table)
                total += grad / dp
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------ Ray group
def test_distributed_env():
    assert distributed_env(3, 8, "10.0.0.1", 29500) == {
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "RANK": "3",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "0",
    }
    with pytest.raises(ValueError, match="rank=8"):
        distributed_env(8, 8, "h", 1)


def test_router_replay_is_the_megatron_trainers_and_the_torch_trainer_refuses_it(swe_config):
    """Router replay on the flagship's layout (SGLang generation, an MoE policy) is accepted by
    the Megatron trainer and refused by the torch trainer, by name, with the fix."""
    replay = {"router_replay": RouterReplayConfig(enabled=True)}
    megatron = _replace(swe_config, policy=replay)
    assert not [i for i in unsupported_by_trainer(megatron) if "router_replay" in i.key]
    torch_trainer = megatron.model_copy(update={"trainer": TorchTrainerConfig()})
    [issue] = [i for i in unsupported_by_trainer(torch_trainer) if "router_replay" in i.key]
    assert "the torch trainer does not replay MoE routing" in issue.problem
    assert issue.fix == "set trainer=megatron, or policy.router_replay.enabled=false"


def test_router_replay_with_pipeline_stages_and_recomputation_is_refused(swe_config):
    """A pipeline schedule runs later micro-batches' forwards before an earlier one's backward,
    whose recomputation would replay their routes."""
    config = _replace(
        swe_config,
        policy={"router_replay": RouterReplayConfig(enabled=True)},
        trainer={"pipeline_model_parallel_size": 2, "activation_checkpointing": True},
    )
    [issue] = [
        i for i in unsupported_by_trainer(config) if i.key == "trainer.pipeline_model_parallel_size"
    ]
    assert "trainer.activation_checkpointing=false" in issue.fix
    fine = _replace(config, trainer={"activation_checkpointing": False})
    assert not [
        i for i in unsupported_by_trainer(fine) if i.key == "trainer.pipeline_model_parallel_size"
    ]


def test_router_replay_switches_the_fused_router_off(swe_config):
    """The fused top-k kernel skips the router's replay without a word."""
    replay = _replace(swe_config, policy={"router_replay": RouterReplayConfig(enabled=True)})
    assert provider_overrides(replay)["moe_router_fusion"] is False
    assert "moe_router_fusion" not in provider_overrides(swe_config)

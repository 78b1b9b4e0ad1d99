"""What the Megatron trainer sets on Megatron-Bridge's provider for an MoE policy (pure functions;
the real provider takes them in `test_megatron_moe.py`)."""

from __future__ import annotations

from gymrl.trainer.megatron.arguments import provider_overrides
from tests.gymrl.trainer.megatron_moe import moe_config

MOE_FIELDS = {"moe_router_load_balancing_type", "moe_grouped_gemm", "moe_permute_fusion"}


def test_an_moe_policy_trains_without_the_load_balancing_loss(swe_config):
    """The flagship (Transformer Engine): no aux loss, and TE's grouped GEMM and fused
    permutation left as Bridge sets them."""
    overrides = provider_overrides(swe_config)
    assert overrides["moe_router_load_balancing_type"] == "none"
    assert "moe_grouped_gemm" not in overrides and "moe_permute_fusion" not in overrides


def test_without_transformer_engine_the_experts_run_in_plain_torch():
    config = moe_config(ep=2, ranks=2)
    config = config.model_copy(
        update={"trainer": config.trainer.model_copy(update={"transformer_impl": "local"})}
    )
    overrides = provider_overrides(config)
    assert overrides["expert_model_parallel_size"] == 2
    assert overrides["moe_grouped_gemm"] is False and overrides["moe_permute_fusion"] is False
    assert overrides["moe_router_load_balancing_type"] == "none"


def test_a_dense_policy_gets_no_moe_settings():
    from tests.gymrl.trainer.megatron_setup import megatron_run_config

    dense = megatron_run_config(["policy=smollm2_135m"])
    assert not MOE_FIELDS & set(provider_overrides(dense))

"""`python recipes/grpo.py +experiment=moe_r3_cpu` through the real entry point: router replay
end to end on this CPU. The real SGLang server reports each token's experts, the policy server
holds them per model call, the run attaches them to each episode, and the Megatron trainer (a
Ray actor in its venv, the CPU device shim) replays them in its routers.

Run as a user runs it, without overrides. Marked `slow`, `megatron` and `sglang_cpu` for the
venvs it needs, like test_flagship_cpu.py,
which `.ci/run` runs with `python -m pytest -m 'slow and megatron'`.
"""

import math

import pytest
import torch

from tests.recipes.recipe_runs import read_metrics, run_recipe

pytestmark = [pytest.mark.slow, pytest.mark.megatron, pytest.mark.sglang_cpu]

# The tiny MoE's routes per position: 4 layers x 2 experts, one byte each.
ROUTE_BYTES_PER_TOKEN = 8.0


def test_router_replay_trains_the_tiny_moe_with_every_tokens_routes(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("moe_r3_cpu is the CPU form (its SGLang server runs on the CPU)")
    # The command as a user runs it (a venv `make` has not made stops it, naming its target),
    # with this checkout's code whichever checkout the editable install points at.
    done = run_recipe(
        tmp_path,
        "+experiment=moe_r3_cpu",
        "logger.wandb.mode=disabled",
        timeout=1800,
        this_checkout_first=True,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    records = read_metrics(tmp_path)
    assert [record["step"] for record in records] == [1, 2]
    assert records[0]["parity/passed"] == 1  # Megatron with replayed routes computes SGLang's
    for record in records:
        # Two model calls per episode: the second asks only from the first's last token on,
        # and every position of every trained sequence but its last arrives.
        assert record["router_replay/route_rows_expected"] > 0
        received = record["router_replay/route_rows_received"]
        assert received == record["router_replay/route_rows_expected"], record
        assert record["router_replay/fallback_token_share"] == 0.0
        assert record["router_replay/bytes_per_token"] == ROUTE_BYTES_PER_TOKEN
        assert record["router_replay/evicted_calls"] == 0.0
        # float32 on both sides, the same routes: no mismatch beyond summation order.
        assert 0 <= record["train/mismatch/k3_kl"] < 1e-8
        assert record["train/mismatch/large_delta_share"] == 0.0
        assert math.isfinite(record["train/loss"]) and record["train/num_tokens"] > 0

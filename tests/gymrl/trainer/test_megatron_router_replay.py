"""Router replay in the real Megatron trainer (megatron-core 0.19.2, `make megatron-venv`) on the
tiny Qwen3-MoE, at EP 1 on one rank and EP 2 on two (each holding half the experts, the batch
split between them): on CUDA where there is one, else on the CPU over gloo through the
test-only device shim.

The routes replayed are transformers' on the same files (what any engine running these weights
in fp32 routes to), so replaying them must change nothing; routes moved to other experts must
change the log-probabilities, equally at EP 1 and EP 2; a trajectory without routes must take
the live router's choices; and a train step on replayed routes still trains the routers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nemo_gym_ext.ports import free_port
from tests.gymrl.trainer.megatron_moe import router_replay_run
from tests.gymrl.trainer.megatron_setup import megatron_batch

pytestmark = pytest.mark.megatron


@pytest.fixture(scope="module")
def transformers_routes(tiny_moe_dir, tmp_path_factory):
    """Each trajectory's routes as transformers' Qwen3-MoE routes it (top-k of every layer's
    router logits), uint8, the last token without routes (no engine runs it), saved for the
    ranks to load."""
    from gymrl.model.loading import load_pretrained

    model = load_pretrained(tiny_moe_dir, torch.float32).eval()
    top_k = model.config.num_experts_per_tok
    trajectories, _ = megatron_batch(model.config.vocab_size)
    routes = []
    for trajectory in trajectories:
        ids = torch.tensor([trajectory.token_ids])
        with torch.no_grad():
            logits = model(ids, output_router_logits=True).router_logits
        chosen = torch.stack([layer.topk(top_k, dim=-1).indices for layer in logits], dim=1)
        rows = chosen.numpy().astype(np.uint8)
        rows[-1] = np.iinfo(np.uint8).max
        routes.append(rows)
    path = tmp_path_factory.mktemp("routes") / "routes.pt"
    torch.save(routes, path)
    return path


def _spawn(tmp_path_factory, routes_path, *, ep: int) -> dict:
    if torch.cuda.is_available() and torch.cuda.device_count() < ep:
        pytest.skip(f"needs {ep} GPUs, this machine has {torch.cuda.device_count()}")
    out = tmp_path_factory.mktemp(f"r3_ep{ep}") / "run.pt"
    torch.multiprocessing.spawn(
        router_replay_run, args=(ep, free_port(), str(routes_path), str(out)), nprocs=ep, join=True
    )
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def ep1(megatron_runtime, transformers_routes, tmp_path_factory):
    return _spawn(tmp_path_factory, transformers_routes, ep=1)


@pytest.fixture(scope="module")
def ep2(megatron_runtime, transformers_routes, tmp_path_factory):
    return _spawn(tmp_path_factory, transformers_routes, ep=2)


def _generated(run: dict, key: str) -> torch.Tensor:
    """The log-probabilities of the batch's generated tokens under `key`, concatenated."""
    return torch.cat(
        [
            torch.tensor(run[key][index])[torch.tensor(mask, dtype=torch.bool)]
            for index, mask in enumerate(run["loss_masks"])
        ]
    )


def test_every_router_of_the_model_takes_routes(ep1, tiny_moe_dir):
    import json

    layers = json.loads((tiny_moe_dir / "config.json").read_text())["num_hidden_layers"]
    assert ep1["routers"] == layers


@pytest.mark.parametrize("run", ["ep1", "ep2"])
def test_replaying_the_routes_the_weights_choose_changes_nothing(run, request):
    """Routes from another implementation of the same weights land on the same tokens and
    layers: the log-probabilities are the live router's within fp32 noise. Routes placed on the
    wrong tokens or layers would move them by far more (the next test)."""
    seen = request.getfixturevalue(run)
    torch.testing.assert_close(
        _generated(seen, "replayed"), _generated(seen, "live"), rtol=0, atol=1e-5
    )


@pytest.mark.parametrize("run", ["ep1", "ep2"])
def test_replayed_routes_decide_the_experts(run, request):
    seen = request.getfixturevalue(run)
    moved, live = _generated(seen, "moved"), _generated(seen, "live")
    assert (moved - live).abs().mean() > 1e-2


def test_expert_parallel_2_replays_as_expert_parallel_1(ep1, ep2):
    """The moved routes send tokens to experts on the other rank at EP 2: the all-to-all
    dispatch follows the replayed choice, so both layouts compute the same."""
    torch.testing.assert_close(
        _generated(ep2, "moved"), _generated(ep1, "moved"), rtol=0, atol=1e-5
    )
    assert ep2["metrics"]["loss"] == pytest.approx(ep1["metrics"]["loss"], abs=1e-5)


@pytest.mark.parametrize("run", ["ep1", "ep2"])
def test_tokens_without_routes_take_the_live_routers_choice(run, request):
    seen = request.getfixturevalue(run)
    torch.testing.assert_close(
        _generated(seen, "missing"), _generated(seen, "live"), rtol=0, atol=0
    )


@pytest.mark.parametrize("run", ["ep1", "ep2"])
def test_a_step_on_replayed_routes_trains_the_routers(run, request):
    """Only the choice is replayed: the router's scores at the chosen experts weight their
    outputs, so its weights get gradients and move."""
    seen = request.getfixturevalue(run)
    before, after = seen["routers_before"], seen["routers_after"]
    assert before.keys() == after.keys() and before
    assert all(not torch.equal(before[name], after[name]) for name in before)
    assert np.isfinite(seen["metrics"]["loss"])
    assert seen["cleared"], "a later forward must not replay this step's routes"

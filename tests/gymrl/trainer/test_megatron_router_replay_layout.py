"""Router replay's CPU half in the Megatron trainer (`gymrl.trainer.megatron.router_replay` and
`batches.micro_batch_routes`): the routes of a micro-batch in the order each rank's routers see
its tokens, and the replay's choice per token. The real routers are
`test_megatron_router_replay.py`'s."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from gymrl.trainer.megatron.batches import MicroBatch, build_micro_batch, context_parallel_positions
from gymrl.trainer.megatron.router_replay import EngineRoutes, local_routes, set_routes
from tests.gymrl.trainer.fixed_trajectories import fixed_trajectory


def _coded_routes(batch: int, length: int) -> torch.Tensor:
    """Routes `[B, S, 1 layer, 2]` whose first id codes its row and position (b * 100 + s)."""
    code = torch.arange(batch)[:, None] * 100 + torch.arange(length)[None, :]
    return torch.stack([code, -code], dim=-1)[:, :, None, :]


@pytest.mark.parametrize(("cp_size", "tp_size"), [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_each_rank_gets_its_tokens_routes_in_its_routers_order(cp_size, tp_size):
    """Megatron's hidden states are `[s, b, h]`, cut over CP ranks by the load-balanced layout and
    over TP ranks along s under sequence parallelism; a router flattens them to tokens s-major.
    Every rank's routes must be the routes of exactly its tokens, in that order, and the ranks
    together cover every token once."""
    batch, length = 2, 16
    routes = _coded_routes(batch, length)
    seen = []
    for cp_rank in range(cp_size):
        positions = context_parallel_positions(length, cp_size, cp_rank)
        for tp_rank in range(tp_size):
            tokens = local_routes(
                routes,
                positions,
                sequence_parallel_rank=tp_rank if tp_size > 1 else None,
                sequence_parallel_size=tp_size,
            )
            hidden = torch.arange(length)[positions][:, None].expand(-1, batch)  # [s, b]
            size = len(positions) // tp_size
            mine = hidden[tp_rank * size : (tp_rank + 1) * size]
            rows = torch.arange(batch)[None, :].expand_as(mine)
            expected = (rows * 100 + mine).reshape(-1)
            assert torch.equal(tokens[:, 0, 0], expected)
            assert tokens.dtype == torch.int64
            seen += expected.tolist()
    assert sorted(seen) == sorted(_coded_routes(batch, length)[..., 0, 0].reshape(-1).tolist())


def test_the_replay_takes_the_engines_experts_and_the_live_choice_where_none_arrived():
    scores = torch.tensor([[0.1, 0.9, 0.5, 0.3], [0.8, 0.2, 0.6, 0.4], [0.3, 0.1, 0.2, 0.7]])
    replay = EngineRoutes(layer_index=0)
    set_routes([replay], torch.tensor([[[3, 0]], [[-1, -1]], [[1, 2]]]))

    def topk(values, k, num_groups=None, group_topk=None):
        return torch.topk(values, k, dim=1)

    values, chosen = replay.get_replay_topk(scores, 2, None, None, topk)
    assert chosen.tolist() == [[3, 0], [0, 2], [1, 2]]
    assert torch.equal(values, scores.gather(1, chosen))
    set_routes([replay], None)
    assert torch.equal(replay.get_replay_topk(scores, 2, None, None, topk)[1], topk(scores, 2)[1])
    set_routes([replay], torch.zeros(2, 1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="routes were sliced for another layout"):
        replay.get_replay_topk(scores, 2, None, None, topk)


def test_a_micro_batch_carries_its_rows_routes_with_minus_one_where_none():
    """The trajectory's missing id (255 in uint8), padding and filler rows all become -1."""
    first = fixed_trajectory(prompt=3, generated=2)
    routes = np.full((5, 2, 2), 7, np.uint8)
    routes[4] = 255  # the last token
    routed = dataclasses.replace(first, routed_experts=routes)
    bare = fixed_trajectory(prompt=2, generated=1)
    batch = build_micro_batch(
        [routed, bare], torch.zeros(2), MicroBatch(indices=(0, 1, None), seq_length=8)
    )
    got = batch["routed_experts"]
    assert got.shape == (3, 8, 2, 2) and got.dtype == torch.int16
    assert (got[0, :4] == 7).all() and (got[0, 4:] == -1).all()
    assert (got[1:] == -1).all()
    plain = build_micro_batch([bare], torch.zeros(1), MicroBatch(indices=(0,), seq_length=4))
    assert "routed_experts" not in plain

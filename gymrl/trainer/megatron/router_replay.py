"""Router replay (R3) in the Megatron trainer: each MoE router takes the experts the generation
engine routed each token to, instead of choosing its own, for the log-probability and training
passes.

megatron-core 0.19.2 routes through `topk_routing_with_score_function`, which asks the router's
`router_replay` object for the top-k (`get_replay_topk(scores, topk, num_groups, group_topk,
default_compute_topk)`) whenever one is set. :class:`EngineRoutes` is such an object, set on
every router of this rank's model by :func:`install_route_replay` (found by walking the model,
not through `RouterReplay.global_router_replay_instances`, which keeps stale entries of models
built before). It differs from Megatron's own `RouterReplay` where the engine's routes need it:

* a token without routes (the trajectory's missing id: the last token, padding, or routes that
  never arrived) takes the live router's choice instead of crashing the gather on a -1;
* its target stays set until the next micro-batch's, so the recomputation of activation
  checkpointing in the backward pass replays the same routes (with one pipeline stage, each
  micro-batch's backward follows its forward; the validator refuses pipeline parallelism with
  activation checkpointing under router replay).

Only the selection is replayed: the returned top-k values are the router's own scores at the
replayed experts, so the router is still trained. The fused top-k kernel
(`moe_router_fusion=True`) bypasses `router_replay` silently, so it is switched off under router
replay (`gymrl.trainer.megatron.arguments.provider_overrides`) and checked here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class EngineRoutes:
    """The replay of one router (the model's layer `layer_index`, from 0)."""

    def __init__(self, layer_index: int):
        self.layer_index = layer_index
        self.target: torch.Tensor | None = None  # [tokens, top-k], -1 where none arrived

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(scores at the chosen experts, the chosen experts)`: the engine's where it routed
        the token, the live router's where not."""
        assert default_compute_topk is not None, "megatron-core passes its own top-k"
        live_values, live = default_compute_topk(scores, topk, num_groups, group_topk)
        target = self.target
        if target is None:
            return live_values, live
        if target.shape != live.shape:
            raise ValueError(
                f"router replay of layer {self.layer_index}: routes for {list(target.shape)} "
                f"[tokens, top-k], but the router sees {list(live.shape)}; the routes were "
                "sliced for another layout"
            )
        missing = (target < 0).any(dim=1, keepdim=True)
        chosen = torch.where(missing, live, target.to(device=live.device, dtype=live.dtype))
        return scores.gather(1, chosen), chosen


def install_route_replay(model_chunks: Iterable[torch.nn.Module]) -> list[EngineRoutes]:
    """Give every MoE router of `model_chunks` an :class:`EngineRoutes` (no target: the live
    router decides until :func:`set_routes`); returns them."""
    from megatron.core.transformer.moe.router import TopKRouter

    replays = []
    for chunk in model_chunks:
        for module in chunk.modules():
            if not isinstance(module, TopKRouter):
                continue
            router: Any = module  # megatron-core is not typed
            if router.config.moe_router_fusion:
                raise ValueError(
                    "router replay needs moe_router_fusion=False: the fused top-k kernel skips "
                    "the router's replay without a word"
                )
            if router.layer_number is None:
                raise ValueError("an MoE router without a layer number cannot be given routes")
            router.router_replay = EngineRoutes(router.layer_number - 1)
            replays.append(router.router_replay)
    if not replays:
        raise ValueError("router replay found no MoE router in the model (is it an MoE model?)")
    return replays


def local_routes(
    routes: torch.Tensor,
    positions: torch.Tensor,
    *,
    sequence_parallel_rank: int | None,
    sequence_parallel_size: int,
) -> torch.Tensor:
    """A micro-batch's routes `[B, S, layers, top-k]` (-1 where none; `batches.build_micro_batch`)
    in the order this rank's routers see tokens: the context-parallel `positions` of each row,
    then sequence-major (`[S, B]` flattened, as Megatron's `[s, b, h]` hidden states), cut to
    this rank's slice of the sequence under sequence parallelism (`sequence_parallel_rank`, its
    TP rank; None without), as int64."""
    local = routes.index_select(1, positions.to(routes.device)).to(torch.int64)
    tokens_first = local.transpose(0, 1)  # [S, B, layers, top-k]
    if sequence_parallel_rank is not None:
        length = tokens_first.shape[0]
        if length % sequence_parallel_size:
            raise ValueError(
                f"{length} positions do not split over {sequence_parallel_size} "
                "sequence-parallel ranks"
            )
        size = length // sequence_parallel_size
        tokens_first = tokens_first[
            sequence_parallel_rank * size : (sequence_parallel_rank + 1) * size
        ]
    return tokens_first.reshape(-1, *tokens_first.shape[2:])


def set_routes(replays: Iterable[EngineRoutes], tokens: torch.Tensor | None) -> None:
    """Give each router its layer's routes (`[tokens, layers, top-k]` from :func:`local_routes`),
    or none (`tokens=None`: the live router decides)."""
    for replay in replays:
        replay.target = None if tokens is None else tokens[:, replay.layer_index, :]

"""One stand-in server: its state and the routes of every concern, on one FastAPI app. Every
request's route and JSON body is kept in `state.requests`, for the contract test against the
pinned wheel (`tests/gymrl/generation/sglang/test_contract.py`)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import torch
from fastapi import FastAPI, Request

from tests.support.sglang_standin.adapters import add_adapter_routes
from tests.support.sglang_standin.generation import add_generation_routes
from tests.support.sglang_standin.refit import add_refit_routes
from tests.support.sglang_standin.state import StandInState
from tests.support.sglang_standin.weights_checker import add_weights_checker_routes


def make_standin(
    context_length: int = 512,
    token_delay_s: float = 0.0,
    *,
    prefill_s_per_token: float = 0.0,
    pause_delay_s: float = 0.0,
    flush_refusals: int = 0,
    cache_tokens: int = 1 << 20,
    model_weights: Mapping[str, torch.Tensor] | None = None,
    end_token_ids: Sequence[int] = (),
) -> tuple[FastAPI, StandInState]:
    """`end_token_ids`: the model's own end ids (its config's `eos_token_id`), where every
    request stops whatever its stop ids, as SGLang stops at `hf_eos_token_id`."""
    state = StandInState(
        context_length,
        token_delay_s,
        prefill_s_per_token,
        pause_delay_s,
        flush_refusals,
        cache_tokens,
        model_weights,
    )
    app = FastAPI()

    @app.middleware("http")
    async def record(request: Request, call_next):
        raw = await request.body()
        state.requests.append((request.url.path, json.loads(raw) if raw else None))
        return await call_next(request)

    add_generation_routes(app, state, end_token_ids)
    add_refit_routes(app, state)
    add_weights_checker_routes(app, state)
    add_adapter_routes(app, state)
    return app, state

"""The stand-in's generation and scheduling routes: `/generate`, `/pause_generation`,
`/continue_generation`, `/flush_cache`, with the pinned server's behaviours the engine must cope
with (read in `sglang/srt/managers/{tokenizer_manager,scheduler,schedule_batch}.py` and
`scheduler_components/flush_wrapper.py` of sglang 0.5.23):

* **An abort runs one more decode step.** The scheduler aborts a running request by setting
  `to_finish`; the request still decodes once and `update_finish_state` turns `to_finish` into
  the finish reason *before* checking stop tokens, so the answer carries one more token, which
  may be the stop token, under finish reason `abort`.
* **Pause in "abort" mode** sets the pause flag (new requests wait before admission), aborts
  everything running and answers only once no request holds the weight-update lock. A request
  that passed the pause check before the flag was set is admitted and then aborted: with
  `pause_delay_s` the stand-in widens that window so a test can land a request in it.
* **`/flush_cache` refuses** (400, "Flush cache failed.") while the scheduler is not idle; with
  `flush_refusals` the first refusals happen even when it looks idle, as when aborted requests are
  still being released by the scheduler.
* **Context length** (`TokenizerManager._validate_one_request`): a prompt of `context_length`
  tokens or more, or a prompt plus `max_new_tokens` beyond it, is refused with SGLang's messages
  in its error shape `{"error": {"message"}}`.
* **Slow tokens and prefill** on demand: `token_delay_s` per generated token, and
  `prefill_s_per_token` per prompt token the radix cache does not hold (`state.py`).

`/generate` answers `meta_info.output_token_logprobs` triples, `finish_reason` objects and
`cached_tokens`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from tests.support.sglang_standin.state import StandInState
from tests.support.sglang_standin.wire import (
    StandInContinueReq,
    StandInGenerateReq,
    StandInPauseReq,
    StandInSamplingParams,
    abort_reason,
    error,
)


def add_generation_routes(app: FastAPI, state: StandInState, end_token_ids: Sequence[int]) -> None:
    """Serve these routes from `app`, over `state`; every request stops at `end_token_ids` (the
    model's own), whatever its stop ids, as SGLang stops at `hf_eos_token_id`."""

    def flush_refused() -> bool:
        """The scheduler refuses a flush while requests run (or refusals are still due)."""
        if state.running or state.flush_refusals > 0:
            state.flush_refusals = max(0, state.flush_refusals - 1)
            return True
        state.cache.clear()
        return False

    @app.post("/generate")
    async def generate(req: StandInGenerateReq):
        state.events.append(("generate", req.model_dump(exclude_unset=True)))
        if req.input_ids is None:
            return error(400, "Either text or input_ids should be provided.")
        prompt = req.input_ids
        params = req.sampling_params or StandInSamplingParams()
        if len(prompt) >= state.context_length:
            return error(
                400,
                f"The input ({len(prompt)} tokens) is longer than the model's context "
                f"length ({state.context_length} tokens).",
            )
        if len(prompt) + params.max_new_tokens > state.context_length:
            return error(
                400,
                "Requested token count exceeds the model's maximum context length of "
                f"{state.context_length} tokens. You requested a total of "
                f"{len(prompt) + params.max_new_tokens} tokens: {len(prompt)} tokens from the "
                f"input messages and {params.max_new_tokens} tokens for the completion. Please "
                "reduce the number of tokens in the input messages or the completion to fit "
                "within the limit.",
            )
        adapter = req.lora_path
        if adapter is not None and (adapter not in state.adapters or adapter in state.unloading):
            return error(
                400,
                f"The following requested LoRA adapters are not loaded: {adapter}\n"
                f"Loaded adapters: {state.adapters.keys() - state.unloading}.",
            )
        await state.resume.wait()  # SGLang holds new requests while generation is paused
        state.running += 1
        if adapter is not None:
            state.adapter_requests[adapter] = state.adapter_requests.get(adapter, 0) + 1
        abort_seen = state.abort_count
        tokens: list[int] = []
        finish: dict[str, Any] = {"type": "length", "length": params.max_new_tokens}
        cached = state.cache.match(prompt)
        state.prompt_tokens += len(prompt)
        state.cached_tokens += cached
        try:
            await asyncio.sleep(state.prefill_s_per_token * (len(prompt) - cached))
            for _ in range(params.max_new_tokens):
                await asyncio.sleep(state.token_delay_s)
                aborted = state.abort_count != abort_seen
                token = len(prompt) + len(tokens) + state.offset
                if aborted and not tokens:
                    # Aborted before its first decode step (e.g. while waiting in the queue):
                    # SGLang answers without tokens.
                    finish = abort_reason("Abort before prefill")
                    break
                tokens.append(token)  # an abort still runs one more decode step
                state.tokens_sampled += 1
                if aborted:  # to_finish wins over the stop-token check
                    finish = abort_reason("Aborted")
                    break
                if token in (params.stop_token_ids or []) or token in end_token_ids:
                    finish = {"type": "stop", "matched": token}
                    break
        finally:
            state.running -= 1
            if adapter is not None:
                state.adapter_requests[adapter] -= 1
        state.cache.insert(prompt + tokens)
        state.finishes.append(finish)
        meta = {
            "id": req.rid or "req",
            "finish_reason": finish,
            "prompt_tokens": len(prompt),
            "weight_version": state.weight_version,
            "completion_tokens": len(tokens),
            "cached_tokens": cached,
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = [[-(t % 7 + 1) / 10, t, None] for t in tokens]
        return {"output_ids": tokens, "meta_info": meta}

    @app.post("/pause_generation")
    async def pause(req: StandInPauseReq):
        state.events.append(("pause", req.mode))
        state.pause_requested.set()
        await asyncio.sleep(state.pause_delay_s)  # requests arriving now are still admitted
        state.paused = True
        state.resume.clear()
        if req.mode == "abort":
            state.abort_count += 1
            while state.running:  # answers once no request holds the weight-update lock
                await asyncio.sleep(0.005)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def resume(req: StandInContinueReq):
        state.events.append(("continue", None))
        state.paused = False
        state.pause_requested.clear()
        state.resume.set()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.get("/get_model_info")
    async def model_info():
        """Answered without generating, paused or not: what the refit's liveness probe asks."""
        return {"model_path": "stand-in", "is_generation": True}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush():
        state.events.append(("flush", None))
        if flush_refused():
            return PlainTextResponse("Flush cache failed.\n", 400)
        return PlainTextResponse("Cache flushed.\n")

"""A loopback stand-in for an SGLang 0.5.23 server, for the CPU tests and the routing benchmark.

SGLang needs CUDA, so the CPU tests run this small FastAPI server instead. It implements the
routes `gymrl.generation.sglang_engine` uses with SGLang's field names and rules: `/generate`
accepts SGLang's `GenerateReqInput` and `SamplingParams` fields (stricter than SGLang, it rejects
unknown ones, so a misspelt key fails here instead of being ignored there) and answers
`meta_info.output_token_logprobs` triples, `finish_reason` objects and `cached_tokens`.

It reproduces the behaviours of the pinned server the engine must cope with (read in
`sglang/srt/managers/{tokenizer_manager,scheduler,schedule_batch}.py` and
`scheduler_components/flush_wrapper.py` of sglang 0.5.23):

* **An abort runs one more decode step.** The scheduler aborts a running request by setting
  `to_finish`; the request still decodes once and `update_finish_state` turns `to_finish` into
  the finish reason *before* checking stop tokens, so the answer carries one more token, which
  may be the stop token, under finish reason `abort`.
* **Pause in "abort" mode** sets the pause flag (new requests wait before admission), aborts
  everything running and answers only once no request holds the weight-update lock. A request
  that passed the pause check before the flag was set is admitted and then aborted: with
  `pause_delay_s` the stand-in widens that window so a test can land a request in it.
* **`/update_weights_from_disk`** waits for SGLang's writer lock (no request running) and loads
  real safetensors files.
* **`/flush_cache` refuses** (400, "Flush cache failed.") while the scheduler is not idle; with
  `flush_refusals` the first refusals happen even when it looks idle, as when aborted requests are
  still being released by the scheduler.
* **Weight sync by broadcast**: `/init_weights_update_group` joins a gloo group as `rank_offset`
  (the stand-in is one TP rank; `backend: nccl` is refused, there is no GPU),
  `/update_weights_from_distributed` receives each named tensor from rank 0 in the order given,
  in place into the stand-in's copy of the weights, and records what came (`received`),
  `/destroy_weights_update_group` leaves the group. Like the disk update, it waits until no request
  runs.
* **Radix (prefix) cache**: each finished request's prompt and output are cached in blocks of
  `CACHE_BLOCK` tokens; a prompt's leading cached blocks count as `cached_tokens` and cost no
  prefill time (`prefill_s_per_token` applies to the rest). `/flush_cache` and a weight update
  empty it.

Its "model" is a deterministic rule (token = prompt length + offset, offset = 1000 x loaded
weight version), so a test can tell which weights produced which token.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict
from safetensors.torch import load_file

from gymrl.generation.routing import block_keys
from gymrl.generation.weight_sync import broadcast, join_weight_update_group

WEIGHT_OFFSET = 1000
CACHE_BLOCK = 16


class StandInSamplingParams(BaseModel):
    """SGLang's `SamplingParams` constructor arguments (sglang/srt/sampling/sampling_params.py)."""

    model_config = ConfigDict(extra="forbid")
    max_new_tokens: int = 128
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = 1
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None


class StandInGenerateReq(BaseModel):
    """The `GenerateReqInput` fields a token-in client may send (managers/io_struct.py)."""

    model_config = ConfigDict(extra="forbid")
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: StandInSamplingParams | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    stream: bool = False
    rid: str | None = None


class StandInUpdateReq(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None


class StandInInitGroupReq(BaseModel):
    """`InitWeightsUpdateGroupReqInput`."""

    model_config = ConfigDict(extra="forbid")
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class StandInDistributedUpdateReq(BaseModel):
    """`UpdateWeightsFromDistributedReqInput`."""

    model_config = ConfigDict(extra="forbid")
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    torch_empty_cache: bool = False


class StandInDestroyGroupReq(BaseModel):
    model_config = ConfigDict(extra="forbid")
    group_name: str = "weight_update_group"


class StandInPauseReq(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["abort", "retract", "in_place"] = "abort"


class PrefixCache:
    """Which leading blocks of token sequences a server holds, least recently used evicted."""

    def __init__(self, capacity_tokens: int) -> None:
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._capacity_blocks = max(1, capacity_tokens // CACHE_BLOCK)

    def match(self, tokens: Sequence[int]) -> int:
        """Tokens at the start of `tokens` that are cached (whole blocks only)."""
        matched = 0
        for key in block_keys(tokens, CACHE_BLOCK):
            if key not in self._blocks:
                break
            self._blocks.move_to_end(key)
            matched += CACHE_BLOCK
        return matched

    def insert(self, tokens: Sequence[int]) -> None:
        for key in block_keys(tokens, CACHE_BLOCK):
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while len(self._blocks) > self._capacity_blocks:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()


class StandInState:
    def __init__(
        self,
        context_length: int,
        token_delay_s: float,
        prefill_s_per_token: float,
        pause_delay_s: float,
        flush_refusals: int,
        cache_tokens: int,
    ) -> None:
        self.context_length = context_length
        self.token_delay_s = token_delay_s
        self.prefill_s_per_token = prefill_s_per_token
        self.pause_delay_s = pause_delay_s
        self.flush_refusals = flush_refusals
        self.events: list[tuple[str, Any]] = []
        self.finishes: list[dict[str, Any]] = []  # each /generate answer's finish_reason
        self.running = 0
        self.tokens_sampled = 0
        self.paused = False
        self.pause_requested = asyncio.Event()  # set when a pause arrives, before it takes effect
        self.abort_count = 0
        self.weight_version = "default"
        self.offset = 0
        self.loaded_tensors: list[str] = []
        self.weights: dict[str, torch.Tensor] = {}  # received by broadcast
        self.received: list[list[tuple[str, str, list[int]]]] = []  # per update call
        self.groups: dict[str, Any] = {}
        self.resume = asyncio.Event()  # set while generation runs, cleared while paused
        self.resume.set()
        self.cache = PrefixCache(cache_tokens)
        self.prompt_tokens = 0
        self.cached_tokens = 0

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _abort_reason(message: str) -> dict[str, Any]:
    """`FINISH_ABORT(...).to_json()`."""
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"object": "error", "message": message, "code": status}, status)


def make_standin(
    context_length: int = 512,
    token_delay_s: float = 0.0,
    *,
    prefill_s_per_token: float = 0.0,
    pause_delay_s: float = 0.0,
    flush_refusals: int = 0,
    cache_tokens: int = 1 << 20,
) -> tuple[FastAPI, StandInState]:
    state = StandInState(
        context_length,
        token_delay_s,
        prefill_s_per_token,
        pause_delay_s,
        flush_refusals,
        cache_tokens,
    )
    app = FastAPI()

    @app.get("/health_generate")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("")

    @app.post("/generate")
    async def generate(req: StandInGenerateReq):
        state.events.append(("generate", req.model_dump(exclude_unset=True)))
        if req.input_ids is None or req.text is not None:
            if req.input_ids is None and req.text is None:
                return _error(400, "Either text or input_ids should be provided.")
            return _error(400, "text input needs a tokenizer; the server skips tokenizer init")
        prompt = req.input_ids
        params = req.sampling_params or StandInSamplingParams()
        if params.temperature < 0 or not 0 < params.top_p <= 1 or params.max_new_tokens < 0:
            return _error(400, f"invalid sampling params {params}")
        if len(prompt) >= state.context_length:
            return _error(
                400,
                f"The input ({len(prompt)} tokens) is longer than the model's context "
                f"length ({state.context_length} tokens).",
            )
        await state.resume.wait()  # SGLang holds new requests while generation is paused
        state.running += 1
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
                    finish = _abort_reason("Abort before prefill")
                    break
                tokens.append(token)  # an abort still runs one more decode step
                state.tokens_sampled += 1
                if aborted:  # to_finish wins over the stop-token check
                    finish = _abort_reason("Aborted")
                    break
                if token in (params.stop_token_ids or []):
                    finish = {"type": "stop", "matched": token}
                    break
        finally:
            state.running -= 1
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
    async def resume():
        state.events.append(("continue", None))
        state.paused = False
        state.pause_requested.clear()
        state.resume.set()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/update_weights_from_disk")
    async def update(req: StandInUpdateReq):
        state.events.append(("update", req.model_dump()))
        for _ in range(200):  # SGLang's writer lock: wait until no request holds the reader lock
            if state.running == 0:
                break
            await asyncio.sleep(0.01)
        else:
            return JSONResponse({"success": False, "message": "requests still running"}, 400)
        files = sorted(Path(req.model_path).glob("*.safetensors"))
        if not files:
            return JSONResponse(
                {"success": False, "message": f"no safetensors in {req.model_path}"}, 400
            )
        state.loaded_tensors = sorted(name for file in files for name in load_file(str(file)))
        state.weight_version = req.weight_version or state.weight_version
        state.offset = WEIGHT_OFFSET * int(state.weight_version)
        state.cache.clear()  # flush_cache=True is the default of UpdateWeightFromDiskReqInput
        return {
            "success": True,
            "message": "Succeeded to update model weights.",
            "num_paused_requests": 0,
        }

    def _success(message: str) -> dict[str, Any]:
        return {"success": True, "message": message}

    def _failure(message: str) -> JSONResponse:
        return JSONResponse({"success": False, "message": message}, 400)

    @app.post("/init_weights_update_group")
    async def init_group(req: StandInInitGroupReq):
        state.events.append(("init_group", req.model_dump()))
        if req.backend != "gloo":
            return _failure(f"the stand-in has no GPU: backend {req.backend!r} (use gloo)")
        if req.group_name in state.groups:
            return _failure(f"Group {req.group_name} already exists.")
        try:
            state.groups[req.group_name] = await asyncio.to_thread(
                join_weight_update_group,
                master_address=req.master_address,
                master_port=req.master_port,
                rank=req.rank_offset,
                world_size=req.world_size,
                backend="gloo",
                timeout_s=30.0,
                group_name=req.group_name,
            )
        except Exception as error:
            return _failure(f"Failed to init group: {error}")
        return _success("Succeeded to initialize custom process group.")

    @app.post("/update_weights_from_distributed")
    async def update_distributed(req: StandInDistributedUpdateReq):
        state.events.append(("update_distributed", req.model_dump()))
        group = state.groups.get(req.group_name)
        if group is None:
            return _failure(f"Group {req.group_name} not in model_update_group.")
        if not len(req.names) == len(req.dtypes) == len(req.shapes):
            return _failure("names, dtypes and shapes differ in length")
        while state.running:  # SGLang's writer lock
            await asyncio.sleep(0.005)
        buffers = []
        for name, dtype, shape in zip(req.names, req.dtypes, req.shapes, strict=True):
            current = state.weights.get(name)
            wanted = getattr(torch, dtype)
            if current is None or list(current.shape) != shape or current.dtype != wanted:
                current = state.weights[name] = torch.empty(shape, dtype=wanted)
            buffers.append(current)  # received in place
        await asyncio.to_thread(broadcast, group, buffers)
        state.received.append(list(zip(req.names, req.dtypes, req.shapes, strict=True)))
        if req.weight_version is not None:
            state.weight_version = req.weight_version
            state.offset = WEIGHT_OFFSET * int(req.weight_version)
        if req.flush_cache:
            state.cache.clear()
        return _success("Succeeded to update parameter online.")

    @app.post("/destroy_weights_update_group")
    async def destroy_group(req: StandInDestroyGroupReq):
        state.events.append(("destroy_group", req.group_name))
        if state.groups.pop(req.group_name, None) is None:
            return _failure(f"Group {req.group_name} not in model_update_group.")
        return _success("Succeeded to destroy custom process group.")

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush():
        state.events.append(("flush", None))
        if state.running or state.flush_refusals > 0:
            state.flush_refusals = max(0, state.flush_refusals - 1)
            return PlainTextResponse("Flush cache failed.\n", 400)
        state.cache.clear()
        return PlainTextResponse("Cache flushed.\n")

    return app, state

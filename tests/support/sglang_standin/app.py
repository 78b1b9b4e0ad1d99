"""A loopback stand-in for an SGLang 0.5.23 server, for the CPU tests and the routing benchmark.

The default test suite runs this small FastAPI server instead of SGLang: it starts in
milliseconds, needs no 6 GB venv, and is made to produce what the real server cannot be made to do
on this CPU or on demand: timed refusals, slow tokens and prefill, flush refusals, a request
landing between a refit's start and its pause, NCCL's refusal, a server that skips a tensor, a
compare that finds a difference (the real one's compare needs CUDA), thousands of requests for the
routing benchmark. What the real server shows here is tested against it (`test_sglang_cpu.py`,
marker `sglang_cpu`), where a differential test sends both the same requests and fails where
status, keys or types differ; the stand-in keeps no behaviour that no test uses.
It implements the routes `gymrl.generation.sglang.engine` uses with SGLang's field names and rules:
`/generate` accepts SGLang's `GenerateReqInput` and `SamplingParams` fields (stricter than SGLang,
it rejects unknown ones, so a misspelt key fails here instead of being ignored there) and answers
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
  real safetensors files into the model, as `load_weights` does (below).
* **`/flush_cache` refuses** (400, "Flush cache failed.") while the scheduler is not idle; with
  `flush_refusals` the first refusals happen even when it looks idle, as when aborted requests are
  still being released by the scheduler.
* **Weight-update sessions** (`scheduler_components/weight_updater.py`):
  `/update_weights_from_distributed` outside `/begin_weight_update` ... `/end_weight_update`
  answers `success: false` and never joins the broadcast; a second begin, or an end without a
  begin, is refused.
* **Weight sync by broadcast**: `/init_weights_update_group` joins a gloo group as `rank_offset`
  (the stand-in is one TP rank; `backend: nccl` is refused, there is no GPU),
  `/update_weights_from_distributed` receives the bucket from rank 0 as one byte buffer cut back
  into tensors (`load_format: "flattened_bucket"`, `FlattenedTensorBucket`: the only format the
  client sends), and records what came (`received`),
  `/destroy_weights_update_group` leaves the group. Update calls run one at a time behind one
  lock (SGLang's writer lock), each once no request runs. SGLang takes each bucket's buffer from
  the CUDA caching allocator, which hands the same memory back refit after refit; the stand-in
  keeps one buffer per bucket layout for the same reason, since a fresh host buffer would be
  faulted in page by page on every refit, a cost no GPU server pays (on this project's CPU
  machine it doubled the stand-in's receive time, benchmarks/README.md, "Flattened buckets").
* **`load_weights` skips names the model does not know** and still reports success: with
  `model_weights` the stand-in's model has exactly those tensors (received values are copied in,
  cast to the model's dtype); without it the model takes whatever arrives.
* **`/get_weights_by_name {name, truncate_size}`** answers the tensor's first `truncate_size`
  rows as float32 lists, or 400 `{"error": {"message": "Get parameter by name failed"}}`.
* **`/weights_checker {action, allow_quant_error, skip_tensor_list, selector}`**
  (`utils/weight_checker.py`, `tokenizer_control_mixin.check_weights`) over the model's tensors,
  as one TP rank: `snapshot` copies them, `reset_tensors` fills them with random values,
  `compare` checks them bit for bit against the snapshot, fails with "check tensor equality
  failed:" and a `name=... max_abs_err=... mean_abs_err=... num_exceed=... expect=...
  actual=...` line per differing tensor (and keeps the snapshot), or drops the snapshot;
  `checksum` answers `ranks` (one `ChecksumInfo` dict) and `per_engine_checksum`. Names
  containing a `skip_tensor_list` entry are left out of all four. The answer is `{success,
  message}` plus the checksum's keys, status 400 when not successful.
* **Context length** (`TokenizerManager._validate_one_request`): a prompt of `context_length`
  tokens or more, or a prompt plus `max_new_tokens` beyond it, is refused with SGLang's messages
  in its error shape `{"error": {"message"}}`.
* **Radix (prefix) cache**: each finished request's prompt and output are cached in blocks of
  `CACHE_BLOCK` tokens; a prompt's leading cached blocks count as `cached_tokens` and cost no
  prefill time (`prefill_s_per_token` applies to the rest). `/flush_cache` empties it (the
  client flushes once per refit, after its updates, which it sends with `flush_cache: false`).

Every request's route and JSON body is kept in `requests`, for the contract test against the
pinned wheel (`test_sglang_contract.py`). Its "model" is a deterministic rule (token = prompt
length + offset, offset = 1000 x loaded weight version), so a test can tell which weights
produced which token.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict
from safetensors.torch import load_file

from gymrl.generation.sglang.routing import block_keys
from gymrl.generation.sglang.weight_sync import (
    FLATTENED_BUCKET,
    broadcast,
    join_weight_update_group,
)

WEIGHT_OFFSET = 1000
CACHE_BLOCK = 16
NO_SESSION = (
    "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
)


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
    input_ids: list[int] | None = None  # optional in SGLang too (it also takes `text`)
    sampling_params: StandInSamplingParams | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    stream: bool = False
    rid: str | None = None


class StandInUpdateReq(BaseModel):
    """`UpdateWeightFromDiskReqInput` (the fields the stand-in acts on)."""

    model_config = ConfigDict(extra="forbid")
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


class StandInInitGroupReq(BaseModel):
    """`InitWeightsUpdateGroupReqInput`."""

    model_config = ConfigDict(extra="forbid")
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class StandInBeginReq(BaseModel):
    """`BeginWeightUpdateReqInput`."""

    model_config = ConfigDict(extra="forbid")
    selector: Literal["target", "draft", "all"] = "all"


class StandInEndReq(BaseModel):
    """`EndWeightUpdateReqInput` (no fields of its own)."""

    model_config = ConfigDict(extra="forbid")


class StandInGetWeightsReq(BaseModel):
    """`GetWeightsByNameReqInput`."""

    model_config = ConfigDict(extra="forbid")
    name: str
    truncate_size: int = 100


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
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False


class StandInCheckWeightsReq(BaseModel):
    """`CheckWeightsReqInput`."""

    model_config = ConfigDict(extra="forbid")
    action: Literal["snapshot", "reset_tensors", "compare", "checksum"] = "checksum"
    allow_quant_error: bool = False
    skip_tensor_list: list[str] | None = None
    selector: Literal["target", "draft", "all"] = "all"


class StandInDestroyGroupReq(BaseModel):
    model_config = ConfigDict(extra="forbid")
    group_name: str = "weight_update_group"


class StandInPauseReq(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["abort", "retract", "in_place"] = "abort"


class StandInContinueReq(BaseModel):
    """`ContinueGenerationReqInput`."""

    model_config = ConfigDict(extra="forbid")
    torch_empty_cache: bool = True


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
        model_weights: Mapping[str, torch.Tensor] | None,
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
        self.weight_version = "0"  # as the launcher starts SGLang: --weight-version 0
        self.offset = 0
        self.loaded_tensors: list[str] = []
        # The model's tensors; received values are copied in. None: it takes whatever arrives.
        self.known_names = None if model_weights is None else frozenset(model_weights)
        self.weights: dict[str, torch.Tensor] = {
            name: tensor.detach().clone() for name, tensor in (model_weights or {}).items()
        }
        self.received: list[list[tuple[str, str, list[int]]]] = []  # per update call
        self.skipped: list[str] = []  # names load_weights did not know
        self.snapshot: dict[str, torch.Tensor] | None = None  # /weights_checker's
        self.groups: dict[str, Any] = {}
        # A flattened bucket's receive buffer, by its (names, dtypes, shapes); without
        # `model_weights` the model's tensors are views of these.
        self.bucket_buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self.session_open = False
        self.update_lock = asyncio.Lock()  # SGLang's writer lock: one update at a time
        self.requests: list[tuple[str, Any]] = []  # (route, JSON body) of every request
        self.resume = asyncio.Event()  # set while generation runs, cleared while paused
        self.resume.set()
        self.cache = PrefixCache(cache_tokens)
        self.prompt_tokens = 0
        self.cached_tokens = 0


def _abort_reason(message: str) -> dict[str, Any]:
    """`FINISH_ABORT(...).to_json()`."""
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


def _error(status: int, message: str) -> JSONResponse:
    """`_create_error_response` of http_server.py."""
    return JSONResponse({"error": {"message": message}}, status)


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
            return _error(400, "Either text or input_ids should be provided.")
        prompt = req.input_ids
        params = req.sampling_params or StandInSamplingParams()
        if len(prompt) >= state.context_length:
            return _error(
                400,
                f"The input ({len(prompt)} tokens) is longer than the model's context "
                f"length ({state.context_length} tokens).",
            )
        if len(prompt) + params.max_new_tokens > state.context_length:
            return _error(
                400,
                "Requested token count exceeds the model's maximum context length of "
                f"{state.context_length} tokens. You requested a total of "
                f"{len(prompt) + params.max_new_tokens} tokens: {len(prompt)} tokens from the "
                f"input messages and {params.max_new_tokens} tokens for the completion. Please "
                "reduce the number of tokens in the input messages or the completion to fit "
                "within the limit.",
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
                if token in (params.stop_token_ids or []) or token in end_token_ids:
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
    async def resume(req: StandInContinueReq):
        state.events.append(("continue", None))
        state.paused = False
        state.pause_requested.clear()
        state.resume.set()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/update_weights_from_disk")
    async def update(req: StandInUpdateReq):
        state.events.append(("update", req.model_dump()))
        await no_request_running()
        files = sorted(Path(req.model_path).glob("*.safetensors"))
        if not files:
            return JSONResponse(
                {"success": False, "message": f"no safetensors in {req.model_path}"}, 400
            )
        loaded = [item for file in files for item in load_file(str(file)).items()]
        state.loaded_tensors = sorted(name for name, _ in loaded)
        _load_weights(loaded)
        state.weight_version = req.weight_version or state.weight_version
        state.offset = WEIGHT_OFFSET * int(state.weight_version)
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

    @app.post("/begin_weight_update")
    async def begin_update(req: StandInBeginReq):
        state.events.append(("begin_update", None))
        if state.session_open:
            return _failure(
                "a weight-update session is already open; call end_weight_update() first"
            )
        state.session_open = True
        return _success("Success")

    @app.post("/end_weight_update")
    async def end_update(req: StandInEndReq):
        state.events.append(("end_update", None))
        if not state.session_open:
            return _failure("no weight-update session is open; call begin_weight_update() first")
        state.session_open = False
        return _success("Success")

    @app.post("/update_weights_from_distributed")
    async def update_distributed(req: StandInDistributedUpdateReq):
        state.events.append(("update_distributed", req.model_dump()))
        if not state.session_open:
            return _failure(NO_SESSION)  # and never joins the broadcast
        group = state.groups.get(req.group_name)
        if group is None:
            return _failure(
                f"Failed to receive weights: Group {req.group_name} not in "
                f"{list(state.groups)}. Please call `init_weights_update_group` first."
            )
        if req.load_format != FLATTENED_BUCKET:  # what the client sends (weight_sync.py)
            return _failure(f"the stand-in receives flattened buckets only, not {req.load_format}")
        async with state.update_lock:
            await no_request_running()
            dtypes = [getattr(torch, dtype) for dtype in req.dtypes]
            received = await asyncio.to_thread(
                _receive_flattened, group, req.names, dtypes, req.shapes, state.bucket_buffers
            )
            state.received.append(list(zip(req.names, req.dtypes, req.shapes, strict=True)))
            _load_weights(received)
            if req.weight_version is not None:
                state.weight_version = req.weight_version
                state.offset = WEIGHT_OFFSET * int(req.weight_version)
        return _success("Succeeded to update parameter online.")

    def _load_weights(received: list[tuple[str, torch.Tensor]]) -> None:
        """The model's `load_weights`: known names copied in, unknown ones skipped."""
        for name, tensor in received:
            if state.known_names is None:
                state.weights[name] = tensor  # a view of this call's own receive buffer
            elif name in state.known_names:
                state.weights[name].copy_(tensor)
            else:
                state.skipped.append(name)

    async def no_request_running() -> None:
        """SGLang's writer lock: an update waits until no request holds the reader lock (every
        request ends within its max_new_tokens, and a pause aborts them)."""
        while state.running:
            await asyncio.sleep(0.005)

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights(req: StandInGetWeightsReq):
        state.events.append(("get_weights", req.name))
        tensor = state.weights.get(req.name)
        if tensor is None:
            return _error(400, "Get parameter by name failed")
        return tensor.to(torch.float32).tolist()[: req.truncate_size]

    @app.api_route("/weights_checker", methods=["GET", "POST"])
    async def check_weights(req: StandInCheckWeightsReq | None = None):
        req = req or StandInCheckWeightsReq()
        state.events.append(("weights_checker", req.action))
        model = {} if req.selector == "draft" else state.weights  # it has no draft model
        checked = {
            name: tensor
            for name, tensor in model.items()
            if not any(pattern in name for pattern in req.skip_tensor_list or ())
        }
        body: dict[str, Any] = {"success": True, "message": "Success."}
        if req.action == "snapshot":
            state.snapshot = {name: tensor.clone() for name, tensor in model.items()}
        elif req.action == "reset_tensors":
            for tensor in checked.values():
                tensor.copy_(_random_like(tensor))
        elif req.action == "compare":
            assert state.snapshot is not None, "the client compares only after a snapshot"
            differing = [
                _difference(name, state.snapshot[name], tensor)
                for name, tensor in checked.items()
                if not torch.equal(state.snapshot[name], tensor)
            ]
            if differing:
                return _failure("check tensor equality failed:\n" + "\n".join(differing))
            state.snapshot = None
        elif req.action == "checksum":
            rank = _checksum_info(checked)
            body["ranks"] = [rank]
            engine = hashlib.sha256(rank["per_gpu_checksum"].encode())
            body["per_engine_checksum"] = engine.hexdigest()
        return body

    @app.post("/destroy_weights_update_group")
    async def destroy_group(req: StandInDestroyGroupReq):
        state.events.append(("destroy_group", req.group_name))
        if state.groups.pop(req.group_name, None) is None:
            return _failure(f"Group {req.group_name} not in model_update_group.")
        return _success("Succeeded to destroy custom process group.")

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush():
        state.events.append(("flush", None))
        if flush_refused():
            return PlainTextResponse("Flush cache failed.\n", 400)
        return PlainTextResponse("Cache flushed.\n")

    return app, state


def _random_like(tensor: torch.Tensor) -> torch.Tensor:
    """`reset_tensors`' values: uniform in [0, 1) (the tests' weights are floating point)."""
    return torch.rand(tensor.shape).to(tensor.dtype)


def _difference(name: str, expect: torch.Tensor, actual: torch.Tensor) -> str:
    """One line of a failed compare, in the wheel's words (`_check_tensors`)."""
    errors = (actual.float() - expect.float()).abs()
    return (
        f"name={name} max_abs_err={errors.max().item()} mean_abs_err={errors.mean().item()} "
        f"num_exceed={int((errors > 0).sum())} "
        f"expect=raw(shape={tuple(expect.shape)} dtype={expect.dtype}) "
        f"actual=raw(shape={tuple(actual.shape)} dtype={actual.dtype}) "
    )


def _checksum_info(tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """A `ChecksumInfo` of one TP rank: a digest per tensor, one over all of them (by name)."""
    checksums = {name: _digest(tensor) for name, tensor in tensors.items()}
    overall = hashlib.sha256()
    for name in sorted(checksums):
        overall.update(name.encode())
        overall.update(checksums[name].encode())
    placement = {"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1}
    placement |= {"pp_rank": 0, "pp_size": 1, "rank": 0, "size": 1}
    return {
        "checksums": checksums,
        "per_gpu_checksum": overall.hexdigest(),
        "parallelism_info": [placement],
    }


def _digest(tensor: torch.Tensor) -> str:
    """16 hex digits of the tensor's bytes (the wheel's `tensor_hash`, formatted `016x`)."""
    data = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def _receive_flattened(
    group: Any,
    names: Sequence[str],
    dtypes: Sequence[torch.dtype],
    shapes: Sequence[list[int]],
    buffers: dict[tuple[Any, ...], torch.Tensor],
) -> list[tuple[str, torch.Tensor]]:
    """`FlattenedTensorBucket.empty` + one broadcast + `reconstruct_tensors`, into the buffer
    kept for this layout (made on its first use). A layout's buffer is reused only by the same
    names, so the views the model holds of an earlier bucket are never overwritten by another."""
    offsets = [0]
    for dtype, shape in zip(dtypes, shapes, strict=True):
        offsets.append(offsets[-1] + torch.Size(shape).numel() * dtype.itemsize)
    layout = (tuple(names), tuple(dtypes), tuple(tuple(shape) for shape in shapes))
    flat = buffers.get(layout)
    if flat is None:
        flat = buffers[layout] = torch.empty(offsets[-1], dtype=torch.uint8)
    broadcast(group, [flat])
    return [
        (name, flat[start:end].view(dtype).reshape(shape))
        for name, dtype, shape, start, end in zip(
            names, dtypes, shapes, offsets[:-1], offsets[1:], strict=True
        )
    ]

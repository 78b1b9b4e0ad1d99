"""The stand-in's refit routes, SGLang 0.5.23's weight-update protocol
(`scheduler_components/weight_updater.py`):

* **`/update_weights_from_disk`** waits for SGLang's writer lock (no request running) and loads
  real safetensors files into the model, as `load_weights` does (below).
* **Weight-update sessions**: `/update_weights_from_distributed` outside `/begin_weight_update`
  ... `/end_weight_update` answers `success: false` and never joins the broadcast; a second
  begin, or an end without a begin, is refused.
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
  cast to the model's dtype); without it the model takes whatever arrives
  (`StandInState.load_weights`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI
from safetensors.torch import load_file

from gymrl.generation.sglang.weight_sync import (
    FLATTENED_BUCKET,
    broadcast,
    join_weight_update_group,
)
from tests.support.sglang_standin.state import StandInState
from tests.support.sglang_standin.wire import (
    StandInBeginReq,
    StandInDestroyGroupReq,
    StandInDistributedUpdateReq,
    StandInEndReq,
    StandInInitGroupReq,
    StandInUpdateReq,
    failure,
    success,
)

NO_SESSION = (
    "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
)


def add_refit_routes(app: FastAPI, state: StandInState) -> None:
    """Serve these routes from `app`, over `state`."""

    @app.post("/update_weights_from_disk")
    async def update(req: StandInUpdateReq):
        state.events.append(("update", req.model_dump()))
        await _no_request_running(state)
        files = sorted(Path(req.model_path).glob("*.safetensors"))
        if not files:
            return failure(f"no safetensors in {req.model_path}")
        loaded = [item for file in files for item in load_file(str(file)).items()]
        state.loaded_tensors = sorted(name for name, _ in loaded)
        state.load_weights(loaded)
        state.load_version(req.weight_version or state.weight_version)
        return {
            "success": True,
            "message": "Succeeded to update model weights.",
            "num_paused_requests": 0,
        }

    @app.post("/init_weights_update_group")
    async def init_group(req: StandInInitGroupReq):
        state.events.append(("init_group", req.model_dump()))
        if req.backend != "gloo":
            return failure(f"the stand-in has no GPU: backend {req.backend!r} (use gloo)")
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
            return failure(f"Failed to init group: {error}")
        return success("Succeeded to initialize custom process group.")

    @app.post("/begin_weight_update")
    async def begin_update(req: StandInBeginReq):
        state.events.append(("begin_update", None))
        if state.session_open:
            return failure(
                "a weight-update session is already open; call end_weight_update() first"
            )
        state.session_open = True
        return success("Success")

    @app.post("/end_weight_update")
    async def end_update(req: StandInEndReq):
        state.events.append(("end_update", None))
        if not state.session_open:
            return failure("no weight-update session is open; call begin_weight_update() first")
        state.session_open = False
        return success("Success")

    @app.post("/update_weights_from_distributed")
    async def update_distributed(req: StandInDistributedUpdateReq):
        state.events.append(("update_distributed", req.model_dump()))
        if not state.session_open:
            return failure(NO_SESSION)  # and never joins the broadcast
        group = state.groups.get(req.group_name)
        if group is None:
            return failure(
                f"Failed to receive weights: Group {req.group_name} not in "
                f"{list(state.groups)}. Please call `init_weights_update_group` first."
            )
        if req.load_format != FLATTENED_BUCKET:  # what the client sends (weight_sync.py)
            return failure(f"the stand-in receives flattened buckets only, not {req.load_format}")
        async with state.update_lock:
            await _no_request_running(state)
            dtypes = [getattr(torch, dtype) for dtype in req.dtypes]
            received = await asyncio.to_thread(
                _receive_flattened, group, req.names, dtypes, req.shapes, state.bucket_buffers
            )
            state.received.append(list(zip(req.names, req.dtypes, req.shapes, strict=True)))
            state.load_weights(received)
            if req.weight_version is not None:
                state.load_version(req.weight_version)
        return success("Succeeded to update parameter online.")

    @app.post("/destroy_weights_update_group")
    async def destroy_group(req: StandInDestroyGroupReq):
        state.events.append(("destroy_group", req.group_name))
        if state.groups.pop(req.group_name, None) is None:
            return failure(f"Group {req.group_name} not in model_update_group.")
        return success("Succeeded to destroy custom process group.")


async def _no_request_running(state: StandInState) -> None:
    """SGLang's writer lock: an update waits until no request holds the reader lock (every
    request ends within its max_new_tokens, and a pause aborts them)."""
    while state.running:
        await asyncio.sleep(0.005)


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

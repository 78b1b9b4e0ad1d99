"""The stand-in's LoRA adapter routes, as SGLang 0.5.23 serves them (`http_server.py`,
`managers/tokenizer_control_mixin.py`, `lora/lora_registry.py`, `managers/tp_worker.py`):

* **`/load_lora_adapter_from_tensors`** decodes each TP rank's copy of the pickled tensors (the
  stand-in is one rank: the first), checks `expected_checksums` as every rank does, refuses a
  name already loaded, and answers `success` with `loaded_adapters` (every name loaded, to
  `"__tensor__"`).
* **`/unload_lora_adapter`** stops new requests naming the adapter at once and unloads it once
  no request still running names it (`LoRARegistry.wait_for_unload`); an unknown name fails in
  the tokenizer manager, whose refusal lists no adapters (`loaded_adapters: null`).
* **`/generate` with `lora_path`** runs under that adapter; a name not loaded is refused (400,
  SGLang's message). The stand-in's tokens do not depend on the adapter (its "model" has no
  layers); the tests read which adapter each request named from `state.requests` and
  `state.adapter_requests`.

SGLang 0.5.23 keeps every adapter it loaded until told otherwise; `state.adapters` is what it
holds, so a test counts them.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import pickle

import torch
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from tests.support.sglang_standin.state import StandInState
from tests.support.sglang_standin.wire import StandInLoadAdapterReq, StandInUnloadAdapterReq


def _outcome(
    state: StandInState, success: bool, message: str = "", *, lists: bool = True
) -> JSONResponse:
    """`LoRAUpdateOutput`, 200 on success and 400 otherwise, as `http_server.py` answers it;
    `lists`: false for a refusal of the tokenizer manager's, which lists no adapters (null)."""
    listed = {} if state.hide_adapters else dict.fromkeys(state.adapters, "__tensor__")
    body = {
        "success": success,
        "error_message": message,
        "loaded_adapters": listed if lists else None,
    }
    return JSONResponse(body, 200 if success else 400)


def _checksum(tensor: torch.Tensor) -> str:
    raw = tensor.contiguous().flatten().view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()


def add_adapter_routes(app: FastAPI, state: StandInState) -> None:
    """Serve these routes from `app`, over `state`."""

    @app.post("/load_lora_adapter_from_tensors")
    async def load(req: StandInLoadAdapterReq):
        state.events.append(("load_adapter", req.lora_name))
        if req.lora_name in state.adapters:
            return _outcome(
                state,
                False,
                f"Failed to load LoRA adapter {req.lora_name} because it is already loaded",
            )
        tensors = pickle.loads(base64.b64decode(req.serialized_named_tensors[0]))
        if req.expected_checksums is not None:
            wrong = sorted(
                name
                for name, want in req.expected_checksums.items()
                if name not in tensors or _checksum(tensors[name]) != want
            )
            if wrong or set(tensors) - set(req.expected_checksums):
                return _outcome(state, False, f"[LORA-CHECK] adapter sync MISMATCH: {wrong[:5]}")
        state.adapters[req.lora_name] = tensors
        return _outcome(state, True)

    @app.post("/unload_lora_adapter")
    async def unload(req: StandInUnloadAdapterReq):
        state.events.append(("unload_adapter", req.lora_name))
        if req.lora_name not in state.adapters:
            return _outcome(
                state,
                False,
                f"LoRA with name {req.lora_name} does not exist. Loaded LoRAs: "
                f"{state.adapters.keys()}",
                lists=False,
            )
        state.unloading.add(req.lora_name)  # new requests naming it are refused from now on
        while state.adapter_requests.get(req.lora_name, 0):
            await asyncio.sleep(0.005)
        state.unloading.discard(req.lora_name)
        del state.adapters[req.lora_name]
        return _outcome(state, True)

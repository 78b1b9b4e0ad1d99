"""The stand-in's routes that read its weights back, as a refit check does:

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
  message}` plus the checksum's keys, status 400 when not successful. The real server's compare
  needs CUDA, so this is where a test finds a difference.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch
from fastapi import FastAPI

from tests.support.sglang_standin.state import StandInState
from tests.support.sglang_standin.wire import (
    StandInCheckWeightsReq,
    StandInGetWeightsReq,
    error,
    failure,
)


def add_weights_checker_routes(app: FastAPI, state: StandInState) -> None:
    """Serve these routes from `app`, over `state`."""

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights(req: StandInGetWeightsReq):
        state.events.append(("get_weights", req.name))
        tensor = state.weights.get(req.name)
        if tensor is None:
            return error(400, "Get parameter by name failed")
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
                return failure("check tensor equality failed:\n" + "\n".join(differing))
            state.snapshot = None
        elif req.action == "checksum":
            rank = _checksum_info(checked)
            body["ranks"] = [rank]
            engine = hashlib.sha256(rank["per_gpu_checksum"].encode())
            body["per_engine_checksum"] = engine.hexdigest()
        return body


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

"""SGLang 0.5.23's wire as the stand-in speaks it: the request bodies its routes take, field for
field (stricter than SGLang: an unknown field is refused, so a misspelt key fails here instead of
being ignored there; the contract test holds each to the pinned wheel's own types), and the
shapes of its answers that more than one route gives."""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict


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
    lora_path: str | None = None


class StandInLoadAdapterReq(BaseModel):
    """`LoadLoRAAdapterFromTensorsReqInput` (the fields the stand-in acts on, and those SGLang
    fills in itself)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    config_dict: dict[str, Any]
    serialized_named_tensors: list[str]
    pinned: bool = False
    lora_id: str | None = None
    load_format: str | None = None
    expected_checksums: dict[str, str] | None = None


class StandInUnloadAdapterReq(BaseModel):
    """`UnloadLoRAAdapterReqInput`."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_id: str | None = None


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


def abort_reason(message: str) -> dict[str, Any]:
    """`FINISH_ABORT(...).to_json()`."""
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


def error(status: int, message: str) -> JSONResponse:
    """`_create_error_response` of http_server.py."""
    return JSONResponse({"error": {"message": message}}, status)


def success(message: str) -> dict[str, Any]:
    """A control route's answer when it did what it was asked."""
    return {"success": True, "message": message}


def failure(message: str) -> JSONResponse:
    """A control route's refusal: `success: false`, status 400."""
    return JSONResponse({"success": False, "message": message}, 400)

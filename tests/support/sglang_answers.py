"""The keys of SGLang's answers that the project's client reads, by route, as dotted paths.

One list for the two tests that hold the client to them (in tests/gymrl/generation/sglang/): the
contract test (`test_contract.py`) checks that the pinned wheel's server makes each of them and
that the client's modules read no other, and the differential tests (`test_real_server.py`,
`test_real_server_lora.py`) that the stand-in answers each one the real server does, compared by
`shape`, `differences` and `unanswered` below.
"""

from __future__ import annotations

from typing import Any

_OUTCOME = ("success", "message")  # every control route's answer: the client reads both

CLIENT_READS: dict[str, tuple[str, ...]] = {
    # sglang_engine.parse_generate_response and SGLangEngine._check_server_version
    "/generate": (
        "meta_info.finish_reason.type",
        "meta_info.finish_reason.message",  # an abort's
        "meta_info.output_token_logprobs",
        "meta_info.completion_tokens",
        "meta_info.weight_version",
        "meta_info.routed_experts",  # sglang_engine.parse_routed_experts (router replay)
    ),
    "/update_weights_from_disk": _OUTCOME,  # SGLangEngine.refit_from_disk
    # weight_sync: the session, group and bucket calls
    "/init_weights_update_group": _OUTCOME,
    "/begin_weight_update": _OUTCOME,
    "/update_weights_from_distributed": _OUTCOME,
    "/end_weight_update": _OUTCOME,
    "/destroy_weights_update_group": _OUTCOME,
    # weights_checker: every action's outcome, and the checksum's
    "/weights_checker": (*_OUTCOME, "per_engine_checksum"),
    # SGLangEngine.update_adapter: LoRAUpdateOutput
    "/load_lora_adapter_from_tensors": ("success", "error_message", "loaded_adapters"),
    "/unload_lora_adapter": ("success", "error_message"),
}


def lookup(answer: Any, path: str) -> tuple[bool, Any]:
    """`(found, value)` of the dotted `path` in a JSON answer."""
    for key in path.split("."):
        if not isinstance(answer, dict) or key not in answer:
            return False, None
        answer = answer[key]
    return True, answer


def shape(value):
    """A JSON value's skeleton: dicts by key, lists by their first item, scalars by type. An int
    and a float differ: both servers write floats with a point (`-0.0`, `1.0`), so a count
    answered as a float, or a log-probability as an int, is a difference a client can trip on."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__


def differences(standin, real, where: str = "") -> list[str]:
    """Where the stand-in's answer has a key the real one lacks, or another type there."""
    if isinstance(standin, dict) and isinstance(real, dict):
        found = []
        for key, item in standin.items():
            if key not in real:
                found.append(f"{where}.{key}: only the stand-in answers it")
            else:
                found += differences(item, real[key], f"{where}.{key}")
        return found
    if isinstance(standin, list) and isinstance(real, list):
        return differences(standin[0], real[0], f"{where}[0]") if standin and real else []
    return [] if standin == real else [f"{where}: stand-in {standin}, real {real}"]


def unanswered(route: str, standin, real) -> list[str]:
    """Keys the client reads (`sglang_answers.CLIENT_READS`) that the real server answered and
    the stand-in did not."""
    return [
        f"{route}: {path} answered by the real server only"
        for path in CLIENT_READS.get(route, ())
        if lookup(real, path)[0] and not lookup(standin, path)[0]
    ]

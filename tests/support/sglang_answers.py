"""The keys of SGLang's answers that the project's client reads, by route, as dotted paths.

One list for the two tests that hold the client to them (in tests/gymrl/generation/sglang/): the
contract test (`test_contract.py`) checks that the pinned wheel's server makes each of them and
that the client's modules read no other, and the differential test (`test_real_server.py`) that
the stand-in answers each one the real server does.
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
}


def lookup(answer: Any, path: str) -> tuple[bool, Any]:
    """`(found, value)` of the dotted `path` in a JSON answer."""
    for key in path.split("."):
        if not isinstance(answer, dict) or key not in answer:
            return False, None
        answer = answer[key]
    return True, answer

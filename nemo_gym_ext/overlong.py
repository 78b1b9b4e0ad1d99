"""Whether a Gym episode hit a token limit, from what the result itself says.

Two kinds of agents say it two ways. The built-in agents (`nemo_gym_ext.envs.agent`) mark the
result `overlong: true` when any model call ended with `finish_reason: "length"`. NeMo-Gym's
agents (0.7.0: `simple_agent` and the agents built like it) end the episode at the first model
call whose Responses answer is `status: "incomplete"` with `incomplete_details: {reason:
"max_output_tokens"}` (what its `responses_converter` makes of `finish_reason: "length"`), and
return that last call's response, whose `output` then holds every call's items, as the result's
`response`. Both are per-episode facts, so they survive the contiguity truncation dropping the
turn that hit the limit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

OVERLONG_FLAG = "overlong"
TOKEN_LIMIT_REASON = "max_output_tokens"


def hit_token_limit(result: Mapping[str, Any]) -> bool:
    """True when the result's own `overlong` flag is set, or its response ended incomplete at
    a token limit (`incomplete_details.reason == "max_output_tokens"`)."""
    if result.get(OVERLONG_FLAG):
        return True
    response = result.get("response")
    if not isinstance(response, Mapping):
        return False
    details = response.get("incomplete_details")
    return isinstance(details, Mapping) and details.get("reason") == TOKEN_LIMIT_REASON

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


class PromptTooLongError(ValueError):
    """The policy server refused a row's prompt as longer than its context.

    Seen from the result: the episode hit a token limit before any model call generated a
    token. Gym's `vllm_model` adapter answers a 400 "maximum context length" with an empty
    `finish_reason: "length"` completion, and the built-in agents do the same (the episode ends
    at once), so without this check the refusal would look like a result without token ids. No
    retry can fix it: the run skips the row (`RolloutCollector` adds its prompt size).
    """

    def __init__(self, row_id: str, agent: str):
        super().__init__(
            f"row {row_id!r} (agent {agent!r}): the policy server refused the prompt, longer than "
            "its context (the first model call ended at the token limit with no token generated)"
        )
        self.row_id = row_id
        self.agent = agent


def refused_before_generating(result: Mapping[str, Any]) -> bool:
    """True when `result` hit a token limit and no output item carries a generated token: the
    first model call was refused for want of room in the context."""
    if not hit_token_limit(result):
        return False
    response = result.get("response")
    output = response.get("output") if isinstance(response, Mapping) else None
    if not isinstance(output, list):
        return False
    return not any(
        isinstance(item, Mapping) and item.get("generation_token_ids") for item in output
    )

"""Read the context-compaction contract a Gym agent attaches to a compacted episode's result.

NeMo-Gym's `simple_agent_with_compaction` rewrites an episode's history between model calls (old
tool outputs or reasoning dropped) and says so: its result's `response` carries a
`context_compaction_contract` and, per model call, metadata naming the call's *segment* (a run of
calls whose prompts only append to each other), whether the call was expected to append to the
previous one, the compaction event that opened a new segment, and a sha256 digest binding the
metadata to that call's token arrays. After Gym's `/verify` the contract is schema 3 with
`model_call_metadata`; an agent that skips verification returns schema 2 with the token arrays
themselves in `completion_evidence`.

A declared segment start is a divergence the trainer expects: the postprocessor trains each
segment as a sequence of its own instead of calling the episode non-contiguous. So the contract
is checked before it is believed (:func:`declared_segments`): one metadata entry per model call,
each digest matching the call's arrays, segments numbered 0, 1, 2, ... in order, every call
after a segment's first expected to append, every segment's first call (but the episode's)
naming its compaction event. A contract that fails any of these is refused by name
(:class:`MalformedCompactionContractError`); a divergence it does not declare is left to the
postprocessor's ordinary rules.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

CONTRACT_FIELD = "context_compaction_contract"
_MODE = "exact_trace_authority"
_TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


class MalformedCompactionContractError(ValueError):
    """A result's compaction contract cannot be believed; the message names the row, the field
    and what is wrong with it."""


@dataclass(frozen=True)
class DeclaredSegments:
    """What a verified contract declares about an episode's model calls."""

    starts: frozenset[int]
    """Output-item indices of the calls that open a new segment (the first call excluded)."""

    segments: int
    """Segments the agent declared: its compactions plus one."""


def has_contract(result: Mapping[str, Any]) -> bool:
    """Whether `result` carries a compaction contract (its `response` names one)."""
    response = result.get("response")
    return isinstance(response, Mapping) and response.get(CONTRACT_FIELD) is not None


def declared_segments(result: Mapping[str, Any], where: str) -> DeclaredSegments:
    """The segments `result`'s contract declares, checked against its output's token arrays.

    `where` names the row and agent in errors. Call only where :func:`has_contract` holds. The
    model calls are the output items carrying all three token fields (the one item per call
    Gym's agent reads them from), in order.
    """
    response = result["response"]
    contract = response[CONTRACT_FIELD]
    if not isinstance(contract, Mapping):
        raise _refused(where, CONTRACT_FIELD, f"is a {type(contract).__name__}, not an object")
    schema = contract.get("schema_version")
    if contract.get("mode") != _MODE:
        raise _refused(
            where, f"{CONTRACT_FIELD}.mode", f"is {contract.get('mode')!r}, expected {_MODE!r}"
        )
    if schema == 3:
        metadata_field = "model_call_metadata"
    elif schema == 2:
        metadata_field = "completion_evidence"
    else:
        raise _refused(
            where,
            f"{CONTRACT_FIELD}.schema_version",
            f"is {schema!r}; this recipe reads schema 2 (before Gym's /verify) and 3 (after)",
        )
    metadata = response.get(metadata_field)
    if not isinstance(metadata, list):
        raise _refused(where, metadata_field, "is missing or not a list")
    calls = [
        (index, item)
        for index, item in enumerate(response.get("output") or ())
        if isinstance(item, Mapping) and all(field in item for field in _TOKEN_FIELDS)
    ]
    if len(calls) != len(metadata):
        raise _refused(
            where,
            metadata_field,
            f"describes {len(metadata)} model calls but the output holds {len(calls)} items "
            "with token ids",
        )
    rollout_id = contract.get("rollout_id")
    events = _boundary_event_ids(response, where)
    starts: set[int] = set()
    previous_segment = -1
    for number, ((index, item), entry) in enumerate(zip(calls, metadata, strict=True)):
        field = f"{metadata_field}[{number}]"
        if not isinstance(entry, Mapping):
            raise _refused(where, field, f"is a {type(entry).__name__}, not an object")
        _check_binding(entry, item, field, where, arrays_inline=schema == 2)
        if entry.get("rollout_id") != rollout_id:
            raise _refused(
                where,
                f"{field}.rollout_id",
                f"is {entry.get('rollout_id')!r}, the contract's is {rollout_id!r}",
            )
        segment = entry.get("segment_index")
        if type(segment) is not int:
            raise _refused(where, f"{field}.segment_index", f"is {segment!r}, not an integer")
        appends = entry.get("expected_append_compatible")
        event = entry.get("compaction_event_id")
        if number == 0:
            if segment != 0 or event is not None:
                raise _refused(
                    where,
                    field,
                    f"opens the episode in segment {segment!r} after event {event!r}; the first "
                    "call opens segment 0 with no compaction event",
                )
        elif segment == previous_segment:
            if appends is not True or event is not None:
                raise _refused(
                    where,
                    field,
                    f"stays in segment {segment} but says expected_append_compatible="
                    f"{appends!r}, compaction_event_id={event!r}",
                )
        elif segment == previous_segment + 1:
            if appends is not False or event not in events:
                raise _refused(
                    where,
                    field,
                    f"opens segment {segment} with expected_append_compatible={appends!r} and "
                    f"compaction_event_id={event!r}, which is not one of the response's "
                    "boundary_events",
                )
            starts.add(index)
        else:
            raise _refused(
                where,
                f"{field}.segment_index",
                f"is {segment!r} after segment {previous_segment}; segments are numbered in "
                "order, one at a time",
            )
        previous_segment = segment
    return DeclaredSegments(starts=frozenset(starts), segments=previous_segment + 1)


def evidence_digest(
    prompt: Sequence[int], sampled: Sequence[int], logprobs: Sequence[float]
) -> str:
    """Gym's digest of one model call's arrays (its `canonical_digest`: sorted keys, compact
    separators, no ASCII escaping), which `generation_evidence_digest` must equal."""
    payload = json.dumps(
        {"prompt_token_ids": prompt, "sampled_token_ids": sampled, "sampled_logprobs": logprobs},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def _check_binding(
    entry: Mapping[str, Any],
    item: Mapping[str, Any],
    field: str,
    where: str,
    *,
    arrays_inline: bool,
) -> None:
    """The metadata belongs to this call's arrays: by digest (schema 3) or by equality with the
    arrays it carries itself (schema 2)."""
    arrays = [list(item[name]) for name in _TOKEN_FIELDS]
    if arrays_inline:
        declared = [
            list(entry.get(name) or ())
            for name in ("prompt_token_ids", "sampled_token_ids", "sampled_logprobs")
        ]
        if declared != arrays:
            raise _refused(where, field, "carries token arrays that differ from its output item's")
        return
    digest = entry.get("generation_evidence_digest")
    if digest != evidence_digest(*arrays):
        raise _refused(
            where,
            f"{field}.generation_evidence_digest",
            "does not match its output item's prompt_token_ids, generation_token_ids and "
            "generation_log_probs (the result was altered after the agent wrote it)",
        )


def _boundary_event_ids(response: Mapping[str, Any], where: str) -> frozenset[str]:
    events = response.get("boundary_events") or []
    if not isinstance(events, list) or not all(
        isinstance(event, Mapping) and isinstance(event.get("event_id"), str) for event in events
    ):
        raise _refused(where, "boundary_events", "is not a list of events with an event_id")
    return frozenset(event["event_id"] for event in events)


def _refused(where: str, field: str, problem: str) -> MalformedCompactionContractError:
    return MalformedCompactionContractError(
        f"{where}: response.{field} {problem}; the context-compaction contract cannot be "
        "trusted, so its segments are not trained (is the result altered between the agent and "
        "the recipe, or the agent not NeMo-Gym's simple_agent_with_compaction?)"
    )

"""The compacted Gym results of tests/data/compaction/ (`make_fixtures.py` wrote them from the
servers `+experiment=compaction_gym` runs) hold what the training side reads of a compacted
episode, checked here without Gym:

* `response.output` holds every call's items in order; each call's token bundle is on its last
  item (the one with `generation_token_ids`), as without compaction;
* `response.model_call_metadata` has one entry per call, in the same order, whose
  `generation_evidence_digest` is Gym's `canonical_digest` of that call's prompt, sampled ids and
  log-probabilities (sha256 of their JSON, keys sorted, no spaces);
* inside a segment a call's prompt starts with the previous call's prompt and sampled ids (the
  prefix the agent required); a call with a `compaction_event_id` starts a segment and does not;
* `response.boundary_events` has one entry per compaction, at the call (`applies_to_step`, the
  call's `turn_id`) that starts the new segment.
"""

import hashlib
import json
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "compaction"


def load(name: str) -> tuple[dict, dict]:
    fixture = json.loads((FIXTURES / name).read_text())
    return fixture["row"], fixture["result"]


def canonical_digest(value) -> str:
    """Gym's (responses_api_agents/simple_agent_with_compaction/compaction/history.py)."""
    payload = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def calls(result: dict) -> list[dict]:
    """Each model call's token bundle: the output items that carry one."""
    return [item for item in result["response"]["output"] if "generation_token_ids" in item]


@pytest.mark.parametrize(
    ("name", "segments", "boundaries"),
    [
        ("smollm2_one_compaction.json", [0, 1], [2]),
        ("scripted_two_compactions.json", [0, 0, 1, 1, 2], [3, 5]),
    ],
)
def test_a_compacted_result_declares_its_segments_and_binds_each_call_to_its_tokens(
    name, segments, boundaries
):
    row, result = load(name)
    response = result["response"]
    contract = response["context_compaction_contract"]
    assert (contract["schema_version"], contract["mode"]) == (3, "exact_trace_authority")
    metadata = response["model_call_metadata"]
    assert [call["segment_index"] for call in metadata] == segments
    assert [call["turn_id"] for call in metadata] == list(range(1, len(segments) + 1))
    assert [event["applies_to_step"] for event in response["boundary_events"]] == boundaries
    bundles = calls(result)
    assert len(bundles) == len(metadata)
    previous = None
    for call, bundle in zip(metadata, bundles, strict=True):
        evidence = {
            "prompt_token_ids": bundle["prompt_token_ids"],
            "sampled_token_ids": bundle["generation_token_ids"],
            "sampled_logprobs": bundle["generation_log_probs"],
        }
        assert call["generation_evidence_digest"] == canonical_digest(evidence)
        starts_segment = call["compaction_event_id"] is not None
        assert starts_segment == (call["turn_id"] in boundaries)
        assert call["expected_append_compatible"] == (previous is not None and not starts_segment)
        if previous is not None:
            extends = bundle["prompt_token_ids"][: len(previous)] == previous
            assert extends != starts_segment, call
        previous = bundle["prompt_token_ids"] + bundle["generation_token_ids"]
    assert row["agent_ref"]["name"] == "math_advanced_calculations_simple_agent"

"""Declared compaction: an episode whose agent declares its segments is trained as declared.

The episodes are NeMo-Gym's own (`tests/data/compaction/episodes.json`, written by Gym's
`ContextCompactionSession` and `build_transport_response` in its venv: make_episodes.py says
how): six and seven model calls, compacted twice each. What must hold: every call's generation
trained exactly once, each declared segment a sequence of its own whose first delta is its first
prompt whole, no divergence counted for a declared boundary, a divergence the contract does not
declare handled as in any episode, and a contract that does not match its arrays refused.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from nemo_gym_ext.compaction_contract import (
    CONTRACT_FIELD,
    MalformedCompactionContractError,
    evidence_digest,
)
from nemo_gym_ext.config import NemoGymPostprocessConfig
from nemo_gym_ext.metrics import per_agent_metrics
from nemo_gym_ext.postprocess import (
    COMPACTION_DROPPED_FIELD,
    COMPACTION_SEGMENT_TOKENS_FIELD,
    COMPACTION_SEGMENTS_FIELD,
    COMPACTIONS_FIELD,
    UNDECLARED_FIELD,
    NonContiguousEpisodeError,
    _context_dropped,
    generated_tokens_of,
    postprocess_gym_result,
)
from tests.support.metric_docs import documented_keys, documented_patterns

COMPACTION_FIELDS = (
    COMPACTIONS_FIELD,
    COMPACTION_SEGMENTS_FIELD,
    COMPACTION_SEGMENT_TOKENS_FIELD,
    COMPACTION_DROPPED_FIELD,
    UNDECLARED_FIELD,
)
EPISODES = Path(__file__).resolve().parents[1] / "data" / "compaction" / "episodes.json"
DEFAULT = NemoGymPostprocessConfig()
TRUNCATE = NemoGymPostprocessConfig(truncate_noncontiguous_episodes=True)
SPLIT = NemoGymPostprocessConfig(
    truncate_noncontiguous_episodes=True, split_noncontiguous_segments=1
)
VOCAB_SIZE = 49152


@pytest.fixture(params=["two_per_chunk", "three_per_chunk"])
def episode(request) -> dict:
    return json.loads(EPISODES.read_text())[request.param]


def row_of(result: dict) -> dict:
    return {"id": result["id"], "agent_ref": result["agent_ref"]}


def calls(result: dict) -> list[dict]:
    """The output items carrying a model call's token ids, in order."""
    return [item for item in result["response"]["output"] if "generation_token_ids" in item]


def segment_of(result: dict) -> list[int]:
    return [entry["segment_index"] for entry in result["response"]["model_call_metadata"]]


def generations(log: list[dict]) -> list[list[int]]:
    return [entry["token_ids"] for entry in log if entry["role"] == "assistant"]


def run(result: dict, config: NemoGymPostprocessConfig = DEFAULT):
    return postprocess_gym_result(row_of(result), result, config, vocab_size=VOCAB_SIZE)


def test_the_fixture_is_compacted_and_not_contiguous_without_its_contract(episode):
    """The premise: Gym declared compactions, and without the contract the episode is an
    ordinary non-contiguous one, refused by default."""
    assert max(segment_of(episode)) == 2
    bare = copy.deepcopy(episode)
    del bare["response"][CONTRACT_FIELD]
    with pytest.raises(NonContiguousEpisodeError):
        run(bare)


def test_each_declared_segment_is_a_sequence_trained_once(episode):
    out = run(episode)
    sequences = [out.message_log, *out.segments]
    segments = segment_of(episode)
    assert len(sequences) == max(segments) + 1
    assert out.segment_kinds == ("declared", "declared")
    assert not out.truncated and out.cause == ""
    # Every call's generation exactly once, in order, each in its declared segment's sequence.
    trained = [generation for sequence in sequences for generation in generations(sequence)]
    assert trained == [item["generation_token_ids"] for item in calls(episode)]
    for index, sequence in enumerate(sequences):
        assert len(generations(sequence)) == segments.count(index)
    # A segment's sequence opens with its first call's whole prompt, then only deltas.
    items = calls(episode)
    first_calls = [segments.index(index) for index in range(len(sequences))]
    for sequence, first in zip(sequences, first_calls, strict=True):
        assert sequence[0] == {"role": "user", "token_ids": items[first]["prompt_token_ids"]}
        flat = [token for entry in sequence for token in entry["token_ids"]]
        last = items[first + len(generations(sequence)) - 1]
        assert flat == last["prompt_token_ids"] + last["generation_token_ids"]


def test_the_counts_name_declared_segments_and_no_divergence(episode):
    out = run(episode)
    fields = out.full_result
    later = [t for seq in out.segments for g in generations(seq) for t in g]
    assert fields["compactions"] == 2
    assert fields["compaction_segments"] == 3
    assert fields["compaction_segment_tokens"] == len(later)
    assert fields["compaction_undeclared_divergences"] == 0
    assert fields["noncontiguous_truncated"] is False
    assert fields["compaction_dropped_tokens"] > 0
    kept, dropped = generated_tokens_of(fields)
    assert (kept, dropped) == (sum(len(item["generation_token_ids"]) for item in calls(episode)), 0)
    metrics = per_agent_metrics([fields])
    assert metrics["compacting_agent/compactions/mean"] == 2.0
    assert metrics["compacting_agent/compaction_declared_share"] == 1.0


def break_inside_segment(result: dict) -> int:
    """Corrupt the prompt of the second call of segment 1 (and every later call of that segment,
    as a re-rendered history would), re-signing each so the contract still matches: a
    divergence the contract does not declare. Returns that call's index among the calls."""
    segments = segment_of(result)
    target = segments.index(1) + 1
    assert segments[target] == 1
    items = calls(result)
    metadata = result["response"]["model_call_metadata"]
    for index in range(target, len(items)):
        if segments[index] != 1:
            break
        item = items[index]
        item["prompt_token_ids"][5] = (item["prompt_token_ids"][5] + 1) % VOCAB_SIZE
        metadata[index]["generation_evidence_digest"] = evidence_digest(
            item["prompt_token_ids"], item["generation_token_ids"], item["generation_log_probs"]
        )
    return target


def test_an_undeclared_divergence_is_an_error_by_default(episode):
    target = break_inside_segment(episode)
    with pytest.raises(NonContiguousEpisodeError) as raised:
        run(episode)
    assert raised.value.turn == target


def test_truncation_keeps_the_prefix_before_an_undeclared_divergence(episode):
    target = break_inside_segment(episode)
    out = run(episode, TRUNCATE)
    items = calls(episode)
    trained = [g for seq in (out.message_log, *out.segments) for g in generations(seq)]
    assert trained == [item["generation_token_ids"] for item in items[:target]]
    assert out.truncated and out.dropped_turns == len(items) - target
    fields = out.full_result
    assert fields["compaction_undeclared_divergences"] == 1
    assert fields["compaction_segments"] == 2  # the third was after the dropped tail
    assert fields["compactions"] == 2  # what the agent declared, trained or not
    kept, dropped = generated_tokens_of(fields)
    assert kept + dropped == sum(len(item["generation_token_ids"]) for item in items)
    metrics = per_agent_metrics([fields])
    assert metrics["compacting_agent/compaction_declared_share"] == pytest.approx(2 / 3)


def test_split_mode_keeps_the_tail_and_the_declared_segments_after_it(episode):
    target = break_inside_segment(episode)
    out = run(episode, SPLIT)
    trained = [g for seq in (out.message_log, *out.segments) for g in generations(seq)]
    assert trained == [item["generation_token_ids"] for item in calls(episode)]
    assert out.segment_kinds == ("declared", "tail", "declared")
    assert out.full_result["noncontiguous_segments"] == 1
    assert generations(out.segments[1])[0] == calls(episode)[target]["generation_token_ids"]


@pytest.mark.parametrize(
    ("break_it", "field"),
    [
        (lambda r: calls(r)[1]["generation_token_ids"].__setitem__(0, 7), "digest"),
        (lambda r: r["response"]["model_call_metadata"].pop(), "describes"),
        (lambda r: r["response"]["model_call_metadata"][1].update(segment_index=2), "segment"),
        (lambda r: r["response"]["model_call_metadata"][1].update(segment_index="0"), "integer"),
        (lambda r: r["response"]["boundary_events"].pop(), "boundary_events"),
        (lambda r: r["response"][CONTRACT_FIELD].update(schema_version=4), "schema_version"),
        (lambda r: r["response"]["model_call_metadata"][2].update(rollout_id="x"), "rollout_id"),
    ],
    ids=[
        "altered-ids",
        "missing-call",
        "skipped-segment",
        "text-segment",
        "unknown-event",
        "schema",
        "rollout",
    ],
)
def test_a_contract_that_does_not_hold_is_refused_by_name(episode, break_it, field):
    break_it(episode)
    with pytest.raises(MalformedCompactionContractError, match=field) as raised:
        run(episode, TRUNCATE)
    assert repr(episode["id"]) in str(raised.value)
    masked = run(episode, NemoGymPostprocessConfig(on_malformed_result="mask"))
    assert masked.malformed and masked.message_log == []


def test_an_episode_without_a_contract_carries_no_compaction_fields(episode):
    out = run(
        {**episode, "response": {"output": calls(episode)[:1]}},
    )
    assert out.compaction is None and out.segments is None
    assert not any(key.startswith("compaction") for key in out.full_result)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        # [2, 3, 4] replaced by a one-token marker [99]: 2 tokens net; the generation kept.
        ([1, 99, 5, 6, 20, 21, 30], 2),
        # Nothing removed: the generation is found where it was.
        ([1, 2, 3, 4, 5, 6, 20, 21, 40], 0),
        # The generation rewritten too: everything after the first change (at 2) counts.
        ([1, 2, 77, 30], 6),
        # A marker longer than what it replaced: never below 0.
        ([1, 9, 9, 9, 9, 9, 2, 3, 4, 5, 6, 20, 21], 0),
    ],
)
def test_context_dropped_counts_what_the_compaction_removed(prompt, expected):
    # What the previous call saw: [1, 2, 3, 4, 5, 6] then its generation [20, 21], 8 tokens.
    assert _context_dropped(prompt, [1, 2, 3, 4, 5, 6], [20, 21]) == expected


def test_every_compaction_metric_is_documented(episode):
    """Metric keys are API: each key a compacting agent's results give (under `train/`) is in
    docs/metrics.md, the compaction fields by name."""
    break_inside_segment(episode)
    keys = [f"train/{key}" for key in per_agent_metrics([run(episode, SPLIT).full_result])]
    patterns = documented_patterns()
    assert [key for key in keys if not any(p.match(key) for p in patterns)] == []
    documented = set(documented_keys())
    for field in (*COMPACTION_FIELDS, "compaction_declared_share"):
        assert any(field in key for key in documented), field


@pytest.mark.parametrize(
    ("name", "segments"),
    [("smollm2_one_compaction.json", 2), ("scripted_two_compactions.json", 3)],
)
def test_the_recipes_own_compaction_runs_train_as_declared(name, segments):
    """Results of `+experiment=compaction_gym`'s servers (Gym's agent with the tool-output
    recency policy, the real policy server, SmolLM2's ids; tests/data/compaction/make_fixtures.py)
    train as their contract declares, truncation off."""
    fixture = json.loads((EPISODES.parent / name).read_text())
    result = fixture["result"]
    out = postprocess_gym_result(fixture["row"], result, DEFAULT, vocab_size=VOCAB_SIZE)
    assert out.segment_kinds == ("declared",) * (segments - 1)
    trained = [g for seq in (out.message_log, *out.segments) for g in generations(seq)]
    assert trained == [item["generation_token_ids"] for item in calls(result)]
    fields = out.full_result
    assert (fields["compactions"], fields["compaction_segments"]) == (segments - 1, segments)
    assert fields["compaction_undeclared_divergences"] == 0 and not out.truncated

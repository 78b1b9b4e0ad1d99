"""Turn one NeMo-Gym result into training data, checking that its token history is contiguous.

A Gym agent's result holds the OpenAI Responses output items of an episode. The last item of each
model call carries the token bundle the engine produced: `prompt_token_ids` (the exact prompt it
consumed), `generation_token_ids` and `generation_log_probs`. An item with a non-empty generation
is a *trainable turn*. The episode is *contiguous* when every trainable turn's prompt starts with
everything seen before it (every earlier prompt delta and generation): only then is each generated
span conditioned, in the flattened sequence the trainer sees, on exactly what the sampler saw.

Re-rendering and re-tokenising the conversation between turns can break this. By default that is
an error (:class:`NonContiguousEpisodeError`). With
`env.nemo_gym.truncate_noncontiguous_episodes=true` the first divergent turn and everything after
it are dropped and the contiguous prefix is trained on with the episode's reward. With
`split_noncontiguous_segments=N` as well, each contiguous segment after a divergence (up to N)
is kept as a sequence of its own, trained with the episode's advantage.

Either way the divergence is classified by cause (:func:`divergence_cause`), so a user knows what
to fix: the error names it, and a truncated episode's result carries one 0/1 field per cause
(`noncontiguous_cause/<cause>`), which per-agent metrics turn into shares of divergent episodes.

A divergence the agent declared is none of this. An agent that compacts its context (NeMo-Gym's
`simple_agent_with_compaction`) says where in a contract on its result; once the contract is
verified against the token arrays (`nemo_gym_ext.compaction_contract`), each declared segment is
a sequence of its own, trained with the episode's advantage like split mode's tails, with or
without truncation, and counted (`compactions`, `compaction_*`). Inside a segment the rules above
hold unchanged.

Cost matters: a 200-turn SWE episode repeats its history in every prompt, millions of ids in all.
The walk compares list slices (C speed), converts nothing per turn but the new delta, and copies
the result shallowly.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from nemo_gym_ext.compaction_contract import (
    MalformedCompactionContractError,
    declared_segments,
    has_contract,
)
from nemo_gym_ext.config import NemoGymPostprocessConfig
from nemo_gym_ext.overlong import (
    OVERLONG_FLAG,
    PromptTooLongError,
    hit_token_limit,
    refused_before_generating,
)
from nemo_gym_ext.wire import LOGPROB_TOLERANCE, agent_name_of

TRUNCATED_FLAG = "noncontiguous_truncated"
DROPPED_TURNS_FIELD = "noncontiguous_dropped_turns"
DROPPED_TOKENS_FIELD = "noncontiguous_dropped_tokens"
SEGMENTS_FIELD = "noncontiguous_segments"
SEGMENT_TOKENS_FIELD = "noncontiguous_segment_tokens"
STOPPED_FLAG = "noncontiguous_stopped"
WITHHELD_FLAG = "noncontiguous_withheld"
MALFORMED_FLAG = "malformed_sample"
TURNS_FIELD = "trainable_turns"
GENERATED_TOKENS_FIELD = "generated_tokens"
LONGEST_CALL_FIELD = "longest_call_tokens"
COMPACTIONS_FIELD = "compactions"
COMPACTION_SEGMENTS_FIELD = "compaction_segments"
COMPACTION_SEGMENT_TOKENS_FIELD = "compaction_segment_tokens"
COMPACTION_DROPPED_FIELD = "compaction_dropped_tokens"
UNDECLARED_FIELD = "compaction_undeclared_divergences"
_WINDOW = 8
_ROW_ID_FIELDS = ("id", "task_id", "instance_id")

Decode = Callable[[Sequence[int]], str]
CAUSE_FIELD_PREFIX = "noncontiguous_cause/"
# Why a turn's prompt stopped extending the history, decided on decoded text (see
# `divergence_cause`), and what each cause means, for the error message.
CAUSES = {
    "no_token_ids": "an earlier generation's text is unchanged but its sampled ids were "
    "re-encoded from that text: the client sent no token ids back (text re-rendered); send "
    "earlier assistant turns back with their prompt_token_ids and generation_token_ids",
    "retokenized": "the text is unchanged but text the model did not generate was tokenised "
    "into other ids at a boundary",
    "assistant_edited": "an earlier assistant turn's text changed (a re-templated tool call, "
    "stripped reasoning, a dropped answer)",
    "history_edited": "text the model did not generate changed (an earlier user, tool or system "
    "message edited or compacted, or template text between turns rendered differently)",
    "other": "the texts could not be compared (decoding the ids failed)",
}
# Without a tokenizer only the tokens' positions are known: which causes each one leaves open.
UNDECODED_CAUSES = {
    "unknown_in_generation": "no tokenizer to decode with; the first difference lies in an "
    "earlier generation, so the cause is no_token_ids or assistant_edited",
    "unknown_in_history": "no tokenizer to decode with; the first difference lies in tokens the "
    "model did not generate, so the cause is retokenized or history_edited",
}
ALL_CAUSE_FIELDS = tuple(CAUSE_FIELD_PREFIX + cause for cause in (*CAUSES, *UNDECODED_CAUSES))


class NonContiguousEpisodeError(AssertionError):
    """A trainable turn's prompt does not start with the tokens seen before it.

    An `AssertionError` so that callers which already treat the contiguity assertion as a rollout
    failure keep doing so. `cause` is the postprocessor's verdict (`divergence_cause`); None
    where an error is raised without one.
    """

    def __init__(
        self,
        message: str,
        *,
        agent: str,
        row_id: str,
        turn: int,
        position: int,
        cause: str | None = None,
    ):
        super().__init__(message)
        self.agent = agent
        self.row_id = row_id
        self.turn = turn
        self.position = position
        self.cause = cause

    def __reduce__(self):
        """Picklable, so the error crosses process boundaries (a Ray actor to the driver)."""
        return (
            _rebuild_divergence_error,
            (str(self), self.agent, self.row_id, self.turn, self.position, self.cause),
        )


def _rebuild_divergence_error(
    message: str, agent: str, row_id: str, turn: int, position: int, cause: str | None
) -> NonContiguousEpisodeError:
    return NonContiguousEpisodeError(
        message, agent=agent, row_id=row_id, turn=turn, position=position, cause=cause
    )


class MalformedGymResultError(ValueError):
    """A Gym result whose fields cannot be trained on; the message names the row and the field."""


MessageLog = list[dict[str, Any]]
# The fields a postprocessed result carries (`PostprocessedEpisode.full_result`): a result fed back
# in must not keep an earlier verdict.
_VERDICT_FIELDS = frozenset(
    (
        TRUNCATED_FLAG,
        DROPPED_TURNS_FIELD,
        MALFORMED_FLAG,
        TURNS_FIELD,
        GENERATED_TOKENS_FIELD,
        LONGEST_CALL_FIELD,
        DROPPED_TOKENS_FIELD,
        SEGMENTS_FIELD,
        SEGMENT_TOKENS_FIELD,
        STOPPED_FLAG,
        WITHHELD_FLAG,
        COMPACTIONS_FIELD,
        COMPACTION_SEGMENTS_FIELD,
        COMPACTION_SEGMENT_TOKENS_FIELD,
        COMPACTION_DROPPED_FIELD,
        UNDECLARED_FIELD,
        *ALL_CAUSE_FIELDS,
    )
)
# What a segment after an episode's first is: opened by a compaction its agent declared, or kept
# by split mode after a divergence nobody declared.
DECLARED = "declared"
TAIL = "tail"


@dataclass(frozen=True)
class Compaction:
    """What an episode whose agent declared its compactions (`nemo_gym_ext.compaction_contract`)
    did with its context, for per-agent metrics."""

    compactions: int
    """Compactions the agent declared: its segments less one."""

    dropped_tokens: int
    """Context tokens the compactions removed, net of what they inserted, summed over them
    (:func:`_context_dropped`)."""

    undeclared_divergences: int
    """Divergences inside a declared segment: what the contract did not declare, handled by
    `truncate_noncontiguous_episodes` as in any episode."""


@dataclass(frozen=True)
class PostprocessedEpisode:
    """One Gym result as training data: what :func:`postprocess_gym_result` returns.

    Plain data that pickles, so a rollout shard (a Ray actor) hands it to the driver inside
    `nemo_gym_ext.rollout.GroupOutcome.episodes`. The counts and flags are typed here; per-agent
    metrics read them from :attr:`full_result`, the result with each under its `*_FIELD` /
    `*_FLAG` name.
    """

    message_log: MessageLog
    """The contiguous prefix trained on: user-delta entries (`{"role": "user", "token_ids"}`)
    alternating with assistant entries (`{"role": "assistant", "token_ids",
    "generation_logprobs"}`); empty for a masked malformed result."""

    segments: list[MessageLog] | None
    """The message logs of the sequences trained after the first, each starting with its first
    turn's whole prompt as the delta: the segments the agent opened by a declared compaction,
    and with `split_noncontiguous_segments` the contiguous tail segments kept after undeclared
    divergences (at most that many, later turns dropped); empty when none was kept; None for an
    episode with neither split mode nor a compaction contract. `segment_kinds` says which is
    which."""

    segment_kinds: tuple[str, ...]
    """`DECLARED` or `TAIL` for each of `segments`."""

    compaction: Compaction | None
    """For an episode whose result carries a compaction contract, what its compactions did;
    None otherwise."""

    result: dict[str, Any]
    """The Gym result (a shallow copy, without the fields of an earlier pass), its `agent_ref`
    the row's where the agent echoed none (stock Gym results do not): the row routed it."""

    overlong: bool
    """The episode hit a token limit (`nemo_gym_ext.overlong.hit_token_limit`: the result's own
    flag or Gym's `incomplete_details`), also when the turn that hit it was dropped, so overlong
    filtering still sees the episode."""

    malformed: bool
    """The result's token fields cannot be trained on and `on_malformed_result=mask` masked it:
    no tokens, its reward still in its group's baseline."""

    longest_call_tokens: int
    """The most tokens one model call generated, over every call of the episode, dropped ones
    included: what the soft overlong penalty measures."""

    cause: str
    """Why the episode's history stopped being contiguous (:func:`divergence_cause`: one of
    `CAUSES` with a decoder, of `UNDECODED_CAUSES` without); "" for a contiguous episode. An
    episode with a cause was truncated."""

    dropped_turns: int
    """Trainable turns truncation dropped (with split mode, those no segment kept)."""

    dropped_tokens: int
    """The generated tokens of the dropped turns, which the token ledger counts."""

    stopped: bool | None
    """Of a truncated episode whose policy server stops divergences: whether its generation ended
    at a withheld turn that diverged (the server stopped it); None otherwise."""

    withheld: bool | None
    """Where the policy server stops divergences: whether the episode ended at a withheld turn at
    all, so an episode the server cut short is never taken for a whole one, even where its
    history is contiguous here (the server and the postprocessor disagree; its tokens are
    trained, its reward is the cut-short state's); None where the server does not stop them."""

    @property
    def truncated(self) -> bool:
        return bool(self.cause)

    @property
    def trainable_turns(self) -> int:
        """Model calls trained on: the prefix's (its tail segments' are apart)."""
        return _generations(self.message_log)[0]

    @property
    def generated_tokens(self) -> int:
        """The prefix's generated tokens."""
        return _generations(self.message_log)[1]

    @property
    def segment_tokens(self) -> int:
        """The tail segments' generated tokens (split mode's, after undeclared divergences)."""
        return self._tokens_of(TAIL)

    @property
    def compaction_segment_tokens(self) -> int:
        """The generated tokens of the declared segments after the first."""
        return self._tokens_of(DECLARED)

    def _tokens_of(self, kind: str) -> int:
        return sum(
            _generations(segment)[1]
            for segment, segment_kind in zip(self.segments or (), self.segment_kinds, strict=True)
            if segment_kind == kind
        )

    @property
    def full_result(self) -> dict[str, Any]:
        """The result with this episode's fields under the names per-agent metrics average.

        `overlong`, `noncontiguous_truncated`, `noncontiguous_dropped_turns`, `malformed_sample`,
        `trainable_turns`, `generated_tokens` and `longest_call_tokens` are on every result, so
        their means are rates across a batch, for stock Gym results too; `noncontiguous_withheld`
        on every result of a run whose server stops divergences; `compactions`,
        `compaction_segments`, `compaction_segment_tokens`, `compaction_dropped_tokens` and
        `compaction_undeclared_divergences` on every result that carries a compaction contract
        (their means are per compacting episode). A truncated episode's alone
        also holds `noncontiguous_dropped_tokens`, `noncontiguous_stopped` (where the server
        stops divergences), `noncontiguous_segments` and `noncontiguous_segment_tokens` (split
        mode) and, for every cause the postprocessor could tell, `noncontiguous_cause/<cause>`
        (true for its cause): their per-agent means are shares of the divergent episodes, and a
        contiguous episode's result is the same with truncation on or off.
        """
        fields = {
            **self.result,
            OVERLONG_FLAG: self.overlong,
            TRUNCATED_FLAG: self.truncated,
            DROPPED_TURNS_FIELD: self.dropped_turns,
            MALFORMED_FLAG: self.malformed,
            TURNS_FIELD: self.trainable_turns,
            GENERATED_TOKENS_FIELD: self.generated_tokens,
            LONGEST_CALL_FIELD: self.longest_call_tokens,
        }
        if self.withheld is not None:
            fields[WITHHELD_FLAG] = self.withheld
        if self.compaction is not None:
            fields[COMPACTIONS_FIELD] = self.compaction.compactions
            fields[COMPACTION_SEGMENTS_FIELD] = 1 + self.segment_kinds.count(DECLARED)
            fields[COMPACTION_SEGMENT_TOKENS_FIELD] = self.compaction_segment_tokens
            fields[COMPACTION_DROPPED_FIELD] = self.compaction.dropped_tokens
            fields[UNDECLARED_FIELD] = self.compaction.undeclared_divergences
        if not self.truncated:
            return fields
        fields[DROPPED_TOKENS_FIELD] = self.dropped_tokens
        told = CAUSES if self.cause in CAUSES else UNDECODED_CAUSES
        fields.update({CAUSE_FIELD_PREFIX + cause: cause == self.cause for cause in told})
        if self.stopped is not None:
            fields[STOPPED_FLAG] = self.stopped
        if self.segments is not None:
            fields[SEGMENTS_FIELD] = self.segment_kinds.count(TAIL)
            fields[SEGMENT_TOKENS_FIELD] = self.segment_tokens
        return fields


def postprocess_gym_result(
    row: Mapping[str, Any],
    result: Mapping[str, Any],
    config: NemoGymPostprocessConfig,
    *,
    vocab_size: int | None = None,
    decode: Decode | None = None,
    server_stops_divergences: bool = False,
) -> PostprocessedEpisode:
    """One Gym result as training data (:class:`PostprocessedEpisode` says what each field
    holds), its token history checked for contiguity (see the module docstring).

    This is where a result enters the recipe, so it is the one place that checks what everything
    downstream relies on: a finite reward and the agent (both required even when the tokens are
    masked, since the result still joins its agent's GRPO group and metrics).

    `vocab_size` enables the id range check; `decode` adds text to the divergence message and
    lets the cause be decided on text. `server_stops_divergences` says the policy server ran
    with `generation.server.stop_on_divergence`: the result may then end with a *withheld turn*
    (the server's answer to a diverged request: its prompt ids and an empty generation), which is
    checked like a trainable turn and trains nothing. A result that hit a token limit before
    generating any token raises :class:`nemo_gym_ext.overlong.PromptTooLongError` (the policy
    server refused the prompt). Neither `row` nor `result` is mutated.
    """
    row_id = row_id_of(row, result)
    agent_ref = _agent_ref_of(row, result, row_id)
    agent = agent_ref["name"]
    contracted = has_contract(result)
    episode = PostprocessedEpisode(
        message_log=[],
        segments=[] if config.split_noncontiguous_segments or contracted else None,
        segment_kinds=(),
        compaction=None,
        result=_fresh_result(result, agent_ref),
        overlong=hit_token_limit(result),
        malformed=False,
        longest_call_tokens=0,
        cause="",
        dropped_turns=0,
        dropped_tokens=0,
        stopped=None,
        withheld=None,
    )
    if refused_before_generating(result):  # not a malformed result: masking must not hide it
        raise PromptTooLongError(row_id, agent)
    # A result without a usable reward cannot join a GRPO group even as a masked sample.
    _check_reward(result, agent, row_id)
    try:
        turns = _trainable_turns(result, agent, row_id)
        declared = (
            declared_segments(result, f"row {row_id!r} (agent {agent!r})") if contracted else None
        )
        # Of every call, kept or not: the episode the overlong penalty judges is all of it.
        episode = replace(episode, longest_call_tokens=max(len(turn[2]) for turn in turns))
        withheld = _withheld_turn(result, turns) if server_stops_divergences else None
        if server_stops_divergences:
            episode = replace(episode, withheld=withheld is not None)
        walk = _walk(
            turns,
            withheld,
            config,
            agent,
            row_id,
            vocab_size,
            decode,
            declared_starts=declared.starts if declared else frozenset(),
        )
    except (MalformedGymResultError, MalformedCompactionContractError):
        if config.on_malformed_result == "raise":
            raise
        return replace(episode, malformed=True)
    first, *more = walk.segments
    episode = replace(episode, message_log=first)
    if episode.segments is not None:
        episode = replace(episode, segments=more, segment_kinds=walk.kinds)
    if declared is not None:
        compaction = Compaction(
            compactions=declared.segments - 1,
            dropped_tokens=walk.context_dropped,
            undeclared_divergences=walk.undeclared,
        )
        episode = replace(episode, compaction=compaction)
    if not walk.cause:
        return episode
    return replace(
        episode,
        cause=walk.cause,
        dropped_turns=walk.dropped,
        dropped_tokens=sum(len(turn[2]) for turn in turns[len(turns) - walk.dropped :]),
        stopped=_stopped(withheld, turns[-1]) if server_stops_divergences else None,
    )


def _fresh_result(result: Mapping[str, Any], agent_ref: Mapping[str, Any]) -> dict[str, Any]:
    """A shallow copy of `result` naming `agent_ref`, without a verdict of an earlier pass."""
    fresh = {key: value for key, value in result.items() if key not in _VERDICT_FIELDS}
    fresh["agent_ref"] = agent_ref
    return fresh


def _stopped(
    withheld: tuple[int, list[int]] | None, last_turn: tuple[int, list[int], list[int], list[float]]
) -> bool:
    """Whether the episode ended at a withheld turn whose prompt does not extend its last
    trainable turn: the divergence the server stopped (`noncontiguous_stopped`)."""
    return withheld is not None and not _extends(withheld[1], last_turn[1], last_turn[2])


def _generations(message_log: MessageLog) -> tuple[int, int]:
    """(model calls, generated tokens) of a message log."""
    generations = [entry["token_ids"] for entry in message_log if entry["role"] == "assistant"]
    return len(generations), sum(map(len, generations))


@dataclass(frozen=True)
class _Walk:
    """What :func:`_walk` found: the kept sequences and what was dropped, declared or not."""

    segments: list[MessageLog]
    """The message log of each kept sequence: the first, then the others in episode order."""

    kinds: tuple[str, ...]
    """`DECLARED` or `TAIL` for each sequence after the first."""

    dropped: int
    """Trainable turns dropped after the last kept sequence."""

    cause: str
    """The first undeclared divergence's cause; "" when there was none."""

    undeclared: int
    """Undeclared divergences met (the walk stops at the one it cannot keep a segment after)."""

    context_dropped: int
    """Context tokens the declared compactions removed (:func:`_context_dropped`)."""


def _walk(
    turns: list[tuple[int, list[int], list[int], list[float]]],
    withheld: tuple[int, list[int]] | None,
    config: NemoGymPostprocessConfig,
    agent: str,
    row_id: str,
    vocab_size: int | None,
    decode: Decode | None,
    *,
    declared_starts: frozenset[int],
) -> _Walk:
    """Walk trainable turns into the sequences to train: the first from the episode's start, a
    new one at each turn whose output item opens a segment its agent declared
    (`declared_starts`, from the compaction contract), and at an undeclared divergence either
    the end (truncation; an error without it) or, with `split_noncontiguous_segments`, a tail
    segment (at most that many).

    `seen` is never materialised: while a sequence is contiguous, everything seen before turn k
    is exactly turn k-1's prompt followed by its generation, so two slice comparisons suffice.
    Turn 0 has seen nothing, so it is always contiguous and a truncated prefix is never empty. A
    new sequence starts at its first turn with that turn's whole prompt as its first delta, so
    it is contiguous from there on by the same two comparisons. A `withheld` turn (item index,
    prompt) comes last: it diverges or not like any turn, and adds nothing to a sequence.
    """
    segments: list[MessageLog] = [[]]
    kinds: list[str] = []
    first_cause = ""
    undeclared = 0
    context_dropped = 0
    segment_start = 0
    previous_prompt: list[int] = []
    previous_generation: list[int] = []
    probe = [] if withheld is None else [(*withheld, [], [])]
    for turn, (item_index, prompt, generation, logprobs) in enumerate([*turns, *probe]):
        seen_len = len(previous_prompt) + len(previous_generation)
        extends = _extends(prompt, previous_prompt, previous_generation)
        if turn == len(turns) and extends:
            break  # a withheld turn that extends the history: nothing to add (flagged withheld)
        if 0 < turn < len(turns) and item_index in declared_starts:
            context_dropped += _context_dropped(prompt, previous_prompt, previous_generation)
            segments.append([])
            kinds.append(DECLARED)
            segment_start, seen_len = turn, 0
        elif not extends:
            position = _first_difference(prompt, previous_prompt, previous_generation)
            cause = divergence_cause(turns[segment_start:turn], prompt, position, decode)
            if not config.truncate_noncontiguous_episodes:
                raise _divergence_error(
                    agent,
                    row_id,
                    turn,
                    item_index,
                    prompt,
                    previous_prompt,
                    previous_generation,
                    decode,
                    position=position,
                    cause=cause,
                )
            first_cause = first_cause or cause
            undeclared += 1
            if turn == len(turns) or kinds.count(TAIL) >= config.split_noncontiguous_segments:
                dropped = len(turns) - turn
                return _Walk(
                    segments, tuple(kinds), dropped, first_cause, undeclared, context_dropped
                )
            segments.append([])
            kinds.append(TAIL)
            segment_start, seen_len = turn, 0
        delta = prompt[seen_len:]
        where = f"row {row_id!r} (agent {agent!r}) output item {item_index}"
        _check_ids(delta, vocab_size, f"{where} prompt_token_ids")
        _check_ids(generation, vocab_size, f"{where} generation_token_ids")
        _check_logprobs(logprobs, f"{where} generation_log_probs")
        segments[-1].append({"role": "user", "token_ids": delta})
        segments[-1].append(
            {
                "role": "assistant",
                "token_ids": list(generation),
                "generation_logprobs": list(logprobs),
            }
        )
        previous_prompt, previous_generation = prompt, generation
    return _Walk(segments, tuple(kinds), 0, first_cause, undeclared, context_dropped)


def _context_dropped(
    prompt: list[int], previous_prompt: list[int], previous_generation: list[int]
) -> int:
    """Context tokens a compaction removed, net of the markers it inserted: of what the previous
    call saw (its prompt and generation), the part before that generation's end in the compacted
    `prompt` is kept. The generation is found as the last run of its ids in `prompt` after the
    prefix both share (recency policies keep the latest turn whole); where it is not found (the
    policy rewrote the latest turn too), everything the previous call saw after the first
    changed position counts as removed. Never below 0 (markers longer than what they replace).
    """
    seen = len(previous_prompt) + len(previous_generation)
    shared = _first_difference(prompt, previous_prompt, previous_generation)
    width = len(previous_generation)
    if width:
        for start in range(len(prompt) - width, shared - 1, -1):
            if prompt[start] == previous_generation[0] and (
                prompt[start : start + width] == previous_generation
            ):
                return max(0, seen - (start + width))
    return seen - shared


def _extends(prompt: list[int], previous_prompt: list[int], previous_generation: list[int]) -> bool:
    """Whether `prompt` starts with `previous_prompt` followed by `previous_generation`."""
    seen_len = len(previous_prompt) + len(previous_generation)
    return (
        len(prompt) >= seen_len
        and prompt[: len(previous_prompt)] == previous_prompt
        and prompt[len(previous_prompt) : seen_len] == previous_generation
    )


def generated_tokens_of(result: Mapping[str, Any]) -> tuple[int, int]:
    """(kept, dropped) generated tokens of a postprocessed `full_result` (or its summary): those
    of the turns kept for training (the first sequence, the declared segments and split mode's
    tail segments), and those of the
    turns truncation dropped (absent unless one was). A mapping that did not come through the
    postprocessor has none: (0, 0)."""
    kept = (
        result.get(GENERATED_TOKENS_FIELD, 0)
        + result.get(SEGMENT_TOKENS_FIELD, 0)
        + result.get(COMPACTION_SEGMENT_TOKENS_FIELD, 0)
    )
    return int(kept), int(result.get(DROPPED_TOKENS_FIELD, 0))


def divergence_cause(
    before: Sequence[tuple[int, list[int], list[int], list[float]]],
    prompt: list[int],
    position: int,
    decode: Decode | None,
) -> str:
    """Why `prompt` does not extend the contiguous turns `before` it, first differing at token
    `position`: one of `CAUSES` with `decode`, of `UNDECODED_CAUSES` without.

    The history seen so far splits into segments: prompt deltas (text the model did not
    generate: system, user and tool messages, template text) and generations. The segment
    holding `position` starts a text comparison: the seen segments from there on are decoded
    one by one and the prompt's ids from the same token on as a whole.

    * Same text: the ids differ but not the text. In a generation that means its sampled ids
      were re-encoded from its text, which a server that is sent the ids back never does (this
      recipe's policy server keeps them verbatim, as do NeMo-RL's and Gym's prefix handling):
      `no_token_ids`. In a delta, the text around a boundary was tokenised differently:
      `retokenized`.
    * Other text: the segment holding the first differing character says what changed: a
      generation (`assistant_edited`) or a delta (`history_edited`). Template text that frames
      an assistant turn (its header, Qwen3's empty think block) is not generated, so a template
      that re-renders it differently counts as `history_edited`.
    * `other`: `decode` failed, so the texts could not be compared.

    Without `decode` only the segment of `position` is known, so the cause is
    `unknown_in_generation` (no_token_ids or assistant_edited) or `unknown_in_history`
    (retokenized or history_edited).

    It runs only on a divergent turn: the segment bounds come from the turns' lengths, and only
    the history from the divergent segment on is decoded.
    """
    # bounds[2j] .. bounds[2j+1] is turn j's delta, bounds[2j+1] .. bounds[2j+2] its generation.
    bounds = [0]
    for _, turn_prompt, generation, _ in before:
        bounds += [len(turn_prompt), len(turn_prompt) + len(generation)]
    segment = bisect_right(bounds, position) - 1
    if decode is None:
        return "unknown_in_generation" if segment % 2 else "unknown_in_history"
    _, last_prompt, last_generation, _ = before[-1]
    try:
        seen_texts = [
            decode(_seen_window(last_prompt, last_generation, start, stop))
            for start, stop in zip(bounds[segment:-1], bounds[segment + 1 :], strict=True)
        ]
        prompt_text = decode(prompt[bounds[segment] :])
    except Exception:  # a diagnosis must never replace the error it annotates
        return "other"
    seen_text = "".join(seen_texts)
    if prompt_text.startswith(seen_text):
        return "no_token_ids" if segment % 2 else "retokenized"
    differs_at = _common_prefix_length(seen_text, prompt_text)
    for text in seen_texts:
        if differs_at < len(text):
            break
        differs_at -= len(text)
        segment += 1
    return "assistant_edited" if segment % 2 else "history_edited"


def _trainable_turns(
    result: Mapping[str, Any], agent: str, row_id: str
) -> list[tuple[int, list[int], list[int], list[float]]]:
    """(item index, prompt ids, generation ids, log-probs) of every item with a generation."""
    response = result.get("response")
    output = response.get("output") if isinstance(response, Mapping) else None
    if not isinstance(output, list):
        raise MalformedGymResultError(
            f"row {row_id!r} (agent {agent!r}): result has no list at response.output "
            f"(got {type(output).__name__})"
        )
    turns = []
    for index, item in enumerate(output):
        if not isinstance(item, Mapping):
            raise MalformedGymResultError(
                f"row {row_id!r} (agent {agent!r}): response.output[{index}] is a "
                f"{type(item).__name__}, expected an object"
            )
        generation = item.get("generation_token_ids")
        if not generation:
            continue
        where = f"row {row_id!r} (agent {agent!r}) response.output[{index}]"
        prompt = item.get("prompt_token_ids")
        logprobs = item.get("generation_log_probs")
        if not isinstance(generation, list):
            raise MalformedGymResultError(f"{where}.generation_token_ids is not a list")
        if not isinstance(prompt, list) or not prompt:
            raise MalformedGymResultError(
                f"{where}.prompt_token_ids is missing or empty on an item with a generation"
            )
        if not isinstance(logprobs, list):
            raise MalformedGymResultError(
                f"{where}.generation_log_probs is missing on an item with a generation"
            )
        if len(logprobs) != len(generation):
            raise MalformedGymResultError(
                f"{where}: generation_log_probs has {len(logprobs)} entries but "
                f"generation_token_ids has {len(generation)}"
            )
        turns.append((index, prompt, generation, logprobs))
    if not turns:
        raise MalformedGymResultError(
            f"row {row_id!r} (agent {agent!r}): no output item carries generation_token_ids, "
            "so there is nothing to train on (is the policy server returning token ids?)"
        )
    return turns


def _withheld_turn(
    result: Mapping[str, Any], turns: list[tuple[int, list[int], list[int], list[float]]]
) -> tuple[int, list[int]] | None:
    """(item index, prompt ids) of the server's withheld answer, if the episode ended on one: the
    last output item, after every trainable turn, carrying prompt ids and an empty generation
    (`gymrl.generation.server.app.withheld_answer`)."""
    output = result["response"]["output"]  # a list: _trainable_turns checked it
    index = len(output) - 1
    while index > turns[-1][0] and output[index].get("generation_token_ids") is None:
        index -= 1
    item = output[index]
    prompt = item.get("prompt_token_ids")
    if index > turns[-1][0] and item.get("generation_token_ids") == [] and prompt:
        if not isinstance(prompt, list):
            raise MalformedGymResultError(
                f"response.output[{index}].prompt_token_ids is not a list"
            )
        return index, prompt
    return None


def _check_reward(result: Mapping[str, Any], agent: str, row_id: str) -> None:
    reward = result.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise MalformedGymResultError(
            f"row {row_id!r} (agent {agent!r}): reward must be a finite number, got {reward!r}"
        )


def _check_ids(ids: list[int], vocab_size: int | None, where: str) -> None:
    """Only ever called on a turn's new delta and generation, so the per-id type check is cheap."""
    if not ids:
        return
    for position, token in enumerate(ids):
        if type(token) is not int:
            raise MalformedGymResultError(
                f"{where}[{position}] = {token!r}: token ids must be integers"
            )
    low, high = min(ids), max(ids)
    if low < 0:
        raise MalformedGymResultError(f"{where} holds id {low}; token ids are never negative")
    if vocab_size is not None and high >= vocab_size:
        raise MalformedGymResultError(
            f"{where} holds id {high}, outside the vocabulary [0, {vocab_size})"
        )


def _check_logprobs(logprobs: list[float], where: str) -> None:
    # Builtin sum: overflow becomes -inf and inf + -inf becomes nan, so one finite total means
    # every entry is finite; only then is the per-entry loop skipped.
    try:
        total = sum(logprobs)
        highest = max(logprobs)
    except TypeError as error:
        raise MalformedGymResultError(f"{where} holds a non-numeric value") from error
    if math.isfinite(total) and highest <= LOGPROB_TOLERANCE:
        return
    for position, value in enumerate(logprobs):
        if not math.isfinite(value) or value > LOGPROB_TOLERANCE:
            raise MalformedGymResultError(
                f"{where}[{position}] = {value!r}: a log-probability must be finite and <= 0"
            )


def _divergence_error(
    agent: str,
    row_id: str,
    turn: int,
    item_index: int,
    prompt: list[int],
    previous_prompt: list[int],
    previous_generation: list[int],
    decode: Decode | None,
    *,
    position: int,
    cause: str,
) -> NonContiguousEpisodeError:
    seen_len = len(previous_prompt) + len(previous_generation)
    start, stop = max(0, position - _WINDOW), position + _WINDOW
    expected = _seen_window(previous_prompt, previous_generation, start, stop)
    actual = prompt[start:stop]
    lines = [
        f"non-contiguous episode: agent {agent!r}, row {row_id!r}, trainable turn {turn} "
        f"(output item {item_index}): its prompt ({len(prompt)} tokens) does not start with the "
        f"{seen_len} tokens seen before it; first difference at token {position}.",
        f"  seen   [{start}:{stop}] ids {expected}",
        f"  prompt [{start}:{stop}] ids {actual}",
    ]
    if decode is not None:
        lines.append(f"  seen   text {decode(expected)!r}")
        lines.append(f"  prompt text {decode(actual)!r}")
    lines.append(f"  cause: {cause}: {CAUSES.get(cause) or UNDECODED_CAUSES[cause]}.")
    lines.append(
        "  Set env.nemo_gym.truncate_noncontiguous_episodes=true to train on the contiguous "
        "prefix instead, or make the policy server keep earlier turns' token ids."
    )
    return NonContiguousEpisodeError(
        "\n".join(lines), agent=agent, row_id=row_id, turn=turn, position=position, cause=cause
    )


def _first_difference(prompt: list[int], previous_prompt: list[int], generation: list[int]) -> int:
    """Index of the first token where `prompt` departs from previous_prompt + generation."""
    offset = 0
    for segment in (previous_prompt, generation):
        candidate = prompt[offset : offset + len(segment)]
        if candidate != segment:
            return offset + _common_prefix_length(candidate, segment)
        offset += len(segment)
    return offset


def _common_prefix_length(first: Sequence[Any], second: Sequence[Any]) -> int:
    """How many leading entries (ids or characters) `first` and `second` share."""
    return next(
        (i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b),
        min(len(first), len(second)),
    )


def _seen_window(prompt: list[int], generation: list[int], start: int, stop: int) -> list[int]:
    head = prompt[start:stop]
    tail_start, tail_stop = max(0, start - len(prompt)), max(0, stop - len(prompt))
    return head + generation[tail_start:tail_stop]


def _agent_ref_of(row: Mapping[str, Any], result: Mapping[str, Any], row_id: str) -> Mapping:
    """The result's `agent_ref` if it names an agent, else the row's; they must agree."""
    try:
        routed = agent_name_of(row)
    except ValueError as error:
        raise MalformedGymResultError(f"row {row_id!r}: the row has {error}") from error
    if result.get("agent_ref") is None:
        return row["agent_ref"]
    try:
        echoed = agent_name_of(result)
    except ValueError as error:
        raise MalformedGymResultError(f"row {row_id!r}: the result has {error}") from error
    if echoed != routed:
        raise MalformedGymResultError(
            f"row {row_id!r}: the result names agent {echoed!r} but the row was sent to "
            f"{routed!r}; a Gym agent must echo its row's agent_ref or none"
        )
    return result["agent_ref"]


def row_id_of(row: Mapping[str, Any], result: Mapping[str, Any] | None = None) -> str:
    """A row's identifier for messages: its `id`, `task_id` or `instance_id`."""
    for source in (row, result or {}):
        for field in _ROW_ID_FIELDS:
            if field in source:
                return str(source[field])
    return "<no id>"

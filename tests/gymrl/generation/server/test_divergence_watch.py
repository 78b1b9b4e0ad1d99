"""`DivergenceWatch` on its own: what it remembers, what it calls a divergence, what it forgets.
The policy server's use of it over HTTP is tested in test_app.py."""

from __future__ import annotations

import pytest

from gymrl.generation.server.divergence_watch import DivergenceCounts, DivergenceWatch, Verdict
from nemo_gym_ext.wire import ChatMessage

USER = ChatMessage(role="user", content="Guess my number.")
TOOL = ChatMessage(role="tool", content='{"hint": "higher"}', tool_call_id="call-1")


def answer(text: str, *calls: tuple[str, str]) -> ChatMessage:
    return ChatMessage.model_validate(
        {
            "role": "assistant",
            "content": text,
            "tool_calls": [
                {"id": f"call-{i}", "function": {"name": name, "arguments": arguments}}
                for i, (name, arguments) in enumerate(calls)
            ]
            or None,
        }
    )


GUESS = answer("", ("guess", '{"n": 50}'))
PROMPT, GENERATION = [1, 2, 3, 4], [10, 11, 12]


def watching(**settings) -> DivergenceWatch:
    watch = DivergenceWatch(**({"capacity": 16, "stop": False, "marks_last_s": None} | settings))
    watch.remember(GUESS, PROMPT, GENERATION)
    return watch


def test_a_prompt_that_starts_with_the_answers_ids_extends_it():
    watch = watching()
    assert watch.check([USER, GUESS, TOOL], [*PROMPT, *GENERATION, 20, 21]) is Verdict.EXTENDS
    assert watch.counts() == DivergenceCounts()


@pytest.mark.parametrize(
    "prompt",
    [
        [*PROMPT, 10, 99, 12, 20],  # the generation re-encoded into other ids
        [1, 2, 9, 4, *GENERATION, 20],  # an earlier message edited
        [*PROMPT, 10, 11],  # shorter than what was seen
    ],
    ids=["generation", "history", "short"],
)
@pytest.mark.parametrize("stop", [False, True])
def test_any_other_prompt_is_a_divergence_counted_as_stopped_when_stopping(prompt, stop):
    watch = watching(stop=stop)
    assert watch.check([USER, GUESS, TOOL], prompt) is Verdict.DIVERGED
    assert watch.counts() == DivergenceCounts(detected=1, stopped=int(stop))


def test_the_answer_is_known_by_text_and_tool_calls_not_by_call_ids_or_reasoning():
    watch = watching()
    sent_back = ChatMessage.model_validate(
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "binary search",
            "tool_calls": [
                {"id": "renamed", "function": {"name": "guess", "arguments": '{"n": 50}'}}
            ],
        }
    )
    assert watch.check([USER, sent_back, TOOL], [1, 2, 3]) is Verdict.DIVERGED
    edited = answer("", ("guess", '{"n":50}'))
    assert watch.check([USER, edited, TOOL], [1, 2, 3]) is Verdict.UNKNOWN


def test_episodes_sharing_an_answer_each_extend_their_own_history():
    watch = watching()
    other_prompt = [7, 8, 9]
    watch.remember(GUESS, other_prompt, GENERATION)
    assert watch.check([USER, GUESS], [*other_prompt, *GENERATION]) is Verdict.EXTENDS
    assert watch.check([USER, GUESS], [*PROMPT, *GENERATION]) is Verdict.EXTENDS
    assert watch.check([USER, GUESS], [7, 8, 0, *GENERATION]) is Verdict.DIVERGED


def test_a_first_turn_cannot_diverge_and_an_unknown_answer_is_not_a_divergence():
    watch = watching(stop=True)
    assert watch.check([USER], [1, 2]) is Verdict.EXTENDS
    assert watch.check([USER, answer("never said"), TOOL], [1, 2]) is Verdict.UNKNOWN
    assert watch.counts() == DivergenceCounts(unchecked=1)


def test_the_oldest_answers_are_forgotten_beyond_the_capacity():
    watch = DivergenceWatch(capacity=2, stop=False, marks_last_s=None)
    replies = [answer(f"reply {i}") for i in range(3)]
    for i, reply in enumerate(replies):
        watch.remember(reply, [i], [100 + i])
    assert watch.check([USER, replies[0]], [5]) is Verdict.UNKNOWN
    assert watch.check([USER, replies[1]], [5]) is Verdict.DIVERGED
    assert watch.check([USER, replies[2]], [2, 102, 7]) is Verdict.EXTENDS


def test_a_capacity_below_one_is_refused():
    with pytest.raises(ValueError, match="capacity=0"):
        DivergenceWatch(capacity=0, stop=False, marks_last_s=None)


def test_an_answer_forgotten_and_then_given_again_elsewhere_is_never_a_divergence():
    """Episode A's answer is forgotten, then episode B gets the same text: A's next request must
    be unknown (the watch no longer holds A's ids), not judged against B's ids."""
    watch = DivergenceWatch(capacity=2, stop=True, marks_last_s=None)
    episode_a, episode_b = [1, 2, 3], [7, 8]
    watch.remember(GUESS, episode_a, GENERATION)
    for i in range(2):
        watch.remember(answer(f"reply {i}"), [i], [100 + i])
    watch.remember(GUESS, episode_b, GENERATION)
    assert watch.check([USER, GUESS, TOOL], [*episode_a, *GENERATION, 20]) is Verdict.UNKNOWN
    assert watch.check([USER, GUESS, TOOL], [*episode_b, *GENERATION, 20]) is Verdict.EXTENDS
    assert watch.counts() == DivergenceCounts(unchecked=1)


def test_a_fingerprint_that_lost_one_of_its_answers_still_tells_other_divergences_apart():
    """Forgetting marks what it forgot, nothing else: an answer never forgotten still diverges."""
    watch = DivergenceWatch(capacity=2, stop=False, marks_last_s=None)
    for i in range(3):
        watch.remember(answer(f"reply {i}"), [i], [100 + i])
    assert watch.check([USER, answer("reply 2")], [9, 9]) is Verdict.DIVERGED


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_forgotten_answers_mark_lasts_one_episode_deadline_at_least_then_is_cleared():
    """With clients whose episodes end within `marks_last_s`, a mark is kept for at least that
    long (swapped into the previous bitmap, then cleared), so a long run keeps detecting."""
    clock = Clock()
    watch = DivergenceWatch(capacity=2, stop=False, marks_last_s=100.0, clock=clock)
    watch.remember(GUESS, [1, 2, 3], GENERATION)
    clock.now = 99.0  # forgotten just before the first swap
    for i in range(2):
        watch.remember(answer(f"reply {i}"), [i], [100 + i])
    watch.remember(GUESS, [7, 8], GENERATION)
    elsewhere = [USER, GUESS, TOOL]
    clock.now = 198.0  # the first swap (due since 100) moves the mark to the previous bitmap
    assert watch.check(elsewhere, [1, 2, 3, *GENERATION]) is Verdict.UNKNOWN
    clock.now = 300.0  # the next swap (102 s later, 201 s after the forgetting) clears it
    assert watch.check(elsewhere, [1, 2, 3, *GENERATION]) is Verdict.DIVERGED
    assert watch.counts() == DivergenceCounts(detected=1, unchecked=1)


def test_without_a_deadline_marks_are_kept_for_good():
    clock = Clock()
    watch = DivergenceWatch(capacity=2, stop=False, marks_last_s=None, clock=clock)
    watch.remember(GUESS, [1, 2, 3], GENERATION)
    for i in range(2):
        watch.remember(answer(f"reply {i}"), [i], [100 + i])
    watch.remember(GUESS, [7, 8], GENERATION)
    clock.now = 1e9
    assert watch.check([USER, GUESS, TOOL], [1, 2, 3, *GENERATION]) is Verdict.UNKNOWN

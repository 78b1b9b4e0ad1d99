"""Tell, as a request arrives, that its prompt no longer extends what this server generated.

A client that re-renders an episode's history from text (no token ids sent back) can make the
server tokenise an earlier generation into other ids; the postprocessor finds that only when the
whole episode comes back, and truncation then drops every turn generated after it. The policy
server can see it earlier: it generated the assistant turn the request ends its history with,
so it knows the ids that turn's prompt and generation were. If the new prompt does not start with
them, the episode has diverged here, at this request, and with
`generation.server.stop_on_divergence` the server need not generate the tail that truncation
would throw away.

What is remembered per answer is small: the answer's fingerprint (its text and tool calls, as a
client sends them back; reasoning and call ids left out, since clients drop or rewrite them), the
length of prompt + generation and a 128-bit xxh3 digest of those ids. A request is checked by the
fingerprint of its last assistant message: several answers can share one (episodes of a group
often open with the same tool call), so the request extends the history if its prompt starts with
the ids of any of them. A fingerprint nobody remembers (the client edited the turn, or the answer
was forgotten) is "unknown", never a divergence: the server only ever misses divergences, and
the postprocessor still finds those.

Memory is bounded: the oldest fingerprints are forgotten first (`capacity` answers in all). A
forgotten fingerprint leaves a mark: once episode A's answer is forgotten, episode B may give the
same text later, and A's next request then finds only B's ids under that fingerprint; judging it
against them would invent a divergence. So a request whose prompt extends none of the remembered
answers is a divergence only when no answer of that fingerprint was ever forgotten; otherwise it
is unknown. The marks live in a fixed bitmap (`_FORGET_BITS_PER_ANSWER` bits per remembered
answer, fingerprints hashed into it). A mark shared by two fingerprints only makes more requests
unknown, so detection degrades under memory pressure and never errs the other way; but a bitmap
that only fills would leave a long run's server checking nothing. Where every client's episode
has a deadline (a training or evaluation run: `env.rollout.run_timeout_s`), a mark is needed only
for that long: a live episode's answer was generated, and so forgotten, after the episode began.
The marks then live in two bitmaps, the current and the previous one, swapped and the older
cleared once per deadline, so each mark lasts at least one deadline. A server with clients of no
known deadline (`recipes/serve.py`) keeps its marks for good. Requests the watch could not judge
(their answer forgotten or never seen here) are counted (`unchecked`), so a run sees when
detection decays. Thread-safe: answers are remembered and requests checked on the server's
render worker, counts read by the recipe.
"""

from __future__ import annotations

import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

import orjson
import xxhash

from nemo_gym_ext.wire import ChatMessage


class Verdict(Enum):
    EXTENDS = "extends"
    DIVERGED = "diverged"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class DivergenceCounts:
    """Requests found diverged (`detected`), those answered without generating (`stopped`), and
    those that ended their history with an answer the watch could not judge (`unchecked`: never
    seen by this server, or forgotten)."""

    detected: int = 0
    stopped: int = 0
    unchecked: int = 0


def answer_fingerprint(message: ChatMessage) -> bytes:
    """What identifies an assistant turn as a client sends it back: text and tool calls."""
    calls = [(call.function.name, call.function.arguments) for call in message.tool_calls or ()]
    return xxhash.xxh3_128_digest(orjson.dumps([message.text, calls]))


# 8 bytes per remembered answer (about 100 bytes each): after forgetting about this many times
# `capacity` distinct fingerprints, about 63% of the marks are set.
_FORGET_BITS_PER_ANSWER = 64


def _ids_digest(ids: Sequence[int]) -> bytes:
    return xxhash.xxh3_128_digest(array("q", ids).tobytes())


class DivergenceWatch:
    """Remembers this server's answers and checks requests against them (module docstring)."""

    def __init__(
        self,
        *,
        capacity: int,
        stop: bool,
        marks_last_s: float | None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`marks_last_s`: the longest any client may hold an answer (its episodes' deadline),
        after which a forgotten answer's mark may be cleared; None keeps marks for good."""
        if capacity < 1:
            raise ValueError(f"capacity={capacity} must be >= 1 remembered answer")
        if marks_last_s is not None and marks_last_s <= 0:
            raise ValueError(f"marks_last_s={marks_last_s} must be > 0 seconds, or None")
        self.stop = stop
        self._capacity = capacity
        self._lock = threading.Lock()
        # fingerprint -> {(length of prompt + generation, digest of those ids)}, oldest first.
        self._answers: OrderedDict[bytes, set[tuple[int, bytes]]] = OrderedDict()
        self._size = 0
        # Fingerprints of which an answer was forgotten (module docstring), hashed into bits:
        # marks set since the last swap, and those of the deadline before.
        self._forgotten = bytearray(capacity * _FORGET_BITS_PER_ANSWER // 8)
        self._forgotten_before = bytearray(len(self._forgotten))
        self._marks_last_s = marks_last_s
        self._clock = clock
        self._swapped_at = clock()
        self._counts = DivergenceCounts()

    def remember(self, answer: ChatMessage, prompt: Sequence[int], generation: Sequence[int]):
        """Record an answer this server sent: `prompt` and `generation` are its ids."""
        history = (len(prompt) + len(generation), _ids_digest([*prompt, *generation]))
        key = answer_fingerprint(answer)
        with self._lock:
            known = self._answers.setdefault(key, set())
            self._answers.move_to_end(key)
            if history not in known:
                known.add(history)
                self._size += 1
            self._swap_marks_when_due()
            while self._size > self._capacity:
                forgotten_key, forgotten = self._answers.popitem(last=False)
                self._size -= len(forgotten)
                byte, bit = self._mark_of(forgotten_key)
                self._forgotten[byte] |= bit

    def check(self, messages: Sequence[ChatMessage], prompt: Sequence[int]) -> Verdict:
        """Whether `prompt` (the request's rendered ids) extends the answer its history ends
        with; a divergence is counted, and counted as stopped when the watch stops them."""
        last = next((m for m in reversed(messages) if m.role == "assistant"), None)
        if last is None:
            return Verdict.EXTENDS  # a first turn extends nothing and cannot diverge
        key = answer_fingerprint(last)
        byte, bit = self._mark_of(key)
        with self._lock:
            histories = tuple(self._answers.get(key, ()))
        if not histories:
            return self._unchecked()
        digests = {length: _ids_digest(prompt[:length]) for length, _ in histories}
        if any(length <= len(prompt) and digests[length] == d for length, d in histories):
            return Verdict.EXTENDS
        with self._lock:
            self._swap_marks_when_due()
            if (self._forgotten[byte] | self._forgotten_before[byte]) & bit:
                marked = True  # the answer it ends with may be one we forgot
            else:
                marked = False
                counts = self._counts
                self._counts = DivergenceCounts(
                    counts.detected + 1, counts.stopped + int(self.stop), counts.unchecked
                )
        return self._unchecked() if marked else Verdict.DIVERGED

    def _unchecked(self) -> Verdict:
        """Count a request the watch cannot judge, and say so."""
        with self._lock:
            counts = self._counts
            self._counts = DivergenceCounts(counts.detected, counts.stopped, counts.unchecked + 1)
        return Verdict.UNKNOWN

    def _swap_marks_when_due(self) -> None:
        """Once per `marks_last_s`: the current marks become the previous ones, the previous
        ones are cleared (under the lock)."""
        if self._marks_last_s is None or self._clock() - self._swapped_at < self._marks_last_s:
            return
        self._forgotten, self._forgotten_before = self._forgotten_before, self._forgotten
        self._forgotten[:] = bytes(len(self._forgotten))
        self._swapped_at = self._clock()

    def _mark_of(self, key: bytes) -> tuple[int, int]:
        """(byte, bit mask) of a fingerprint's mark in the forgotten bitmap."""
        index = int.from_bytes(key[:8], "little") % (len(self._forgotten) * 8)
        return index // 8, 1 << (index % 8)

    def counts(self) -> DivergenceCounts:
        with self._lock:
            return self._counts

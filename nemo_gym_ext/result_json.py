"""Parse an agent's `/run` answer without building the ints of repeated prompt prefixes.

Every trainable turn's `prompt_token_ids` repeats the episode's whole history: a 200-call SWE
episode of 64k tokens holds 6.5 M ids, nearly all of them copies of earlier prompts, in 45 MB of
JSON, and creating those Python ints is what parsing costs (0.45 s with orjson, 0.9 s with
`json.loads`). Here the repeats are found in the bytes instead: when an output item's prompt array
starts, byte for byte, with the whole previous prompt array followed by a comma, only the new
elements are parsed, and the list is rebuilt as the previous prompt's list plus them, sharing
their int objects. The parsed result is the same value a JSON parser returns, so the
postprocessor's contract is untouched (benchmarks/bench_postprocess.py times both).

Each prompt array that is only integers is marked before parsing: a string placed first in the
array, naming it (and the earlier array it continues). A marker can only ever sit in such an array
(an id list never holds a string), so reading them back is exact. Whenever anything does not fit
(a marked array outside `response.output`, a repeated key, bytes that are not JSON), the bytes
are parsed whole instead, with orjson, then with `json.loads` (which also takes the NaN and
Infinity that Python's encoder writes), so the answer or the error is what a plain parser gives.
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

_PROMPT_ARRAY = re.compile(rb'"prompt_token_ids"\s*:\s*\[\s*')
_INTEGERS = re.compile(rb"[0-9,\s-]*")
_MARK = "\x00gymrl-prefix:"


def loads_result(raw: bytes) -> Any:
    """The JSON value of `raw`, an agent's `/run` answer (see the module docstring)."""
    marked, continued = _mark_prompt_arrays(raw)
    if marked:
        try:
            value = orjson.loads(marked)
        except orjson.JSONDecodeError:
            pass
        else:
            if _unmark(value, continued):
                return value
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def _mark_prompt_arrays(raw: bytes) -> tuple[bytes, dict[int, int | None]]:
    """`raw` with a marker first in every all-integer prompt array, and for each marked array the
    earlier one it continues (its elements cut from the bytes), or None. Empty when none.

    The bytes of a continued prefix are compared once and never scanned again."""
    view = memoryview(raw)
    pieces: list[bytes | memoryview] = []
    continued: dict[int, int | None] = {}
    copied = 0  # raw[:copied] is in `pieces`
    previous: tuple[int, bytes] | None = None  # (array number, its elements' bytes)
    position = 0
    while (match := _PROMPT_ARRAY.search(raw, position)) is not None:
        start = position = match.end()
        if _escaped(raw, match.start()):  # the text of a string, not a key
            continue
        after = _after_prefix(raw, previous, start)
        end = raw.find(b"]", start if after is None else after)
        if end < 0:
            break
        number = len(continued)
        if after is not None and _INTEGERS.fullmatch(raw, after, end):
            assert previous is not None
            continued[number] = previous[0]
            rest: bytes | memoryview = view[after:end]
        elif _INTEGERS.fullmatch(raw, start, end):
            continued[number] = None
            rest = b", " + raw[start:end] if end > start else b""
        else:
            previous = None
            continue
        mark = json.dumps(f"{_MARK}{number}").encode()
        pieces += [view[copied:start], mark, rest]
        copied = position = end
        previous = (number, raw[start : _trimmed_end(raw, start, end)])
    if not continued:
        return b"", {}
    pieces.append(view[copied:])
    return b"".join(pieces), continued


def _after_prefix(raw: bytes, previous: tuple[int, bytes] | None, start: int) -> int | None:
    """Where the array starting at `start` goes on after every element of `previous`, if it
    starts with them and then a comma or its end; else None."""
    if previous is None or not previous[1] or not raw.startswith(previous[1], start):
        return None
    after = start + len(previous[1])
    following = raw[after : after + 64].lstrip()[:1]
    return after if following in (b",", b"]") else None


def _trimmed_end(raw: bytes, start: int, end: int) -> int:
    while end > start and raw[end - 1] in b" \t\r\n":
        end -= 1
    return end


def _escaped(raw: bytes, quote: int) -> bool:
    """Whether the quote at `quote` is escaped (preceded by an odd number of backslashes)."""
    backslashes = 0
    while quote - backslashes > 0 and raw[quote - backslashes - 1] == ord("\\"):
        backslashes += 1
    return backslashes % 2 == 1


def _unmark(value: Any, continued: dict[int, int | None]) -> bool:
    """Rebuild every marked prompt list of `value` in place; False if the markers found where
    prompts live (`response.output[*].prompt_token_ids`) are not exactly the ones placed."""
    found: dict[int, dict[str, Any]] = {}
    for item in _output_items(value):
        ids = item.get("prompt_token_ids")
        if isinstance(ids, list) and ids and isinstance(ids[0], str) and ids[0].startswith(_MARK):
            number = ids[0][len(_MARK) :]
            if not number.isdigit() or int(number) in found:
                return False
            found[int(number)] = item
    if found.keys() != continued.keys():
        return False
    rebuilt: dict[int, list[Any]] = {}
    for number in sorted(found):
        earlier = continued[number]
        new = found[number]["prompt_token_ids"][1:]
        rebuilt[number] = rebuilt[earlier] + new if earlier is not None else new
        found[number]["prompt_token_ids"] = rebuilt[number]
    return True


def _output_items(value: Any) -> list[dict[str, Any]]:
    response = value.get("response") if isinstance(value, dict) else None
    output = response.get("output") if isinstance(response, dict) else None
    if not isinstance(output, list):
        return []
    return [item for item in output if isinstance(item, dict)]

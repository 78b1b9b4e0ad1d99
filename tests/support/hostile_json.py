"""Hypothesis strategies for hostile JSON, shared by the fuzzing tests of every HTTP server."""

import json

from hypothesis import strategies as st

HUGE_INTS = st.sampled_from([-(2**64), -1, 0, 2**31, 2**63, 2**64, 2**80, 10**30])
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | HUGE_INTS
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=30)
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)
# Bodies no JSON parser should take down: nesting past Python's recursion limit, bytes that are
# not UTF-8, nothing at all, a lone surrogate (valid JSON, not valid text).
PATHOLOGICAL_BODIES = {
    "deep-list": b"[" * 100_000 + b"]" * 100_000,
    "deep-object": b'{"a": ' * 50_000 + b"1" + b"}" * 50_000,
    "not-utf8": b"\xff\xfe not utf-8",
    "empty": b"",
    "lone-surrogate": b'{"a": "\\ud800"}',
}


def encode(body) -> bytes:
    """`body` as the bytes a careless client sends: NaN and Infinity allowed, though not JSON."""
    return body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()

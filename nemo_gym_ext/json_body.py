"""JSON bodies: requests read into a pydantic model in one pass, bodies written with orjson.

FastAPI's own body handling parses with `json.loads` and then validates the Python objects, and
`json.loads` accepts lone UTF-16 surrogates (valid JSON, not valid text), so a server had to walk
every string of the parsed body to refuse them. pydantic-core's JSON parser refuses them by itself
while it parses, builds no intermediate objects, and is several times faster: on a request whose
earlier assistant turns carry their token ids, that walk was most of the cost
(benchmarks/bench_request_parse.py).

Refusals name the field, as before: a validation error carries its location, and only a body that
the parser refuses as JSON is looked at again (with `json.loads`, off the hot path) to say which
field holds the lone surrogate, when that is why.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, TypeVar

import orjson
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

Model = TypeVar("Model", bound=BaseModel)

# Bodies above this size are parsed on a worker thread: below it parsing takes well under a
# millisecond, less than the hop to a thread costs.
OFF_LOOP_BODY_BYTES = 256 * 1024


JSON_HEADERS = {"Content-Type": "application/json"}


def dumps_json(value: Any) -> bytes:
    """`value` as JSON bytes: orjson (several times faster than `json.dumps` on token lists), or
    `json.dumps` for what orjson refuses (an int beyond 64 bits in a row's task fields). orjson
    writes NaN as null, as JSON has no NaN."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        return json.dumps(value).encode()


async def read_json_body(request: Request, model: type[Model]) -> Model:
    """`request`'s body validated as `model`; :class:`RequestValidationError` when it is not one.
    The body is read whole, as long as it is: bound it in front (`http_server.RequestLimits`),
    or read it yourself and call :func:`parse_json_body_off_loop`."""
    return await parse_json_body_off_loop(await request.body(), model)


async def parse_json_body_off_loop(raw: bytes, model: type[Model]) -> Model:
    """:func:`parse_json_body`, off the event loop for a large body, so that one late-turn
    request of an episode does not hold up every other request the server is answering."""
    if len(raw) > OFF_LOOP_BODY_BYTES:
        return await asyncio.to_thread(parse_json_body, raw, model)
    return parse_json_body(raw, model)


def parse_json_body(raw: bytes, model: type[Model]) -> Model:
    """`raw` validated as `model` in one pass; :class:`RequestValidationError` naming the field."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as error:
        errors = error.errors(include_url=False)
        if errors and errors[0]["type"] == "json_invalid":
            errors = [_json_error(raw, errors[0]["msg"])]
        raise RequestValidationError(errors) from None


def _json_error(raw: bytes, parser_message: str) -> dict[str, Any]:
    """The error for a body the parser refused: the field holding a lone surrogate, else the
    parser's own words (not JSON, nested too deep, ...)."""
    try:
        where = lone_surrogate_at(json.loads(raw))
    except (ValueError, RecursionError):
        where = None
    if where is None:
        return {"type": "json_invalid", "loc": ("body",), "msg": parser_message, "input": None}
    # A key may itself hold the surrogate: shown escaped, since the answer must be valid text.
    printable = tuple(
        part.encode("utf-8", "backslashreplace").decode() if isinstance(part, str) else part
        for part in where
    )
    return {
        "type": "value_error",
        "loc": ("body", *printable),
        "msg": "holds a lone UTF-16 surrogate (U+D800..U+DFFF), which is not text; send valid "
        "Unicode",
        "input": None,
    }


def lone_surrogate_at(data: Any) -> tuple[str | int, ...] | None:
    """The location of the first string (or key) in `data` with a lone surrogate, else None.
    Iterative: a hostile body may nest deeper than Python's recursion limit allows."""
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), data)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return where
        elif isinstance(value, dict):
            stack.extend(((*where, key), key) for key in value)
            stack.extend(((*where, key), item) for key, item in value.items())
        elif isinstance(value, list):
            stack.extend(((*where, index), item) for index, item in enumerate(value))
    return None

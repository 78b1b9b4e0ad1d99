"""Reading a chat request's body within what the server's context can hold.

Until issue 42 the policy server's only bound was a flat 64 MiB, so a 30 MB body of text was
read, parsed and tokenised before the context check refused it (41-45 s on a 2-core CPU), and it
held the server's one render worker all that time. Now a body is refused with 413 as soon as it
is known to be over the bound: by its `Content-Length` before a byte of it is read, or, sent
chunked without one, as the bytes read pass it (reading stops there). Reading waits on the
client, so it has a deadline too (408).

The bound follows from the context, :attr:`BodyBound.max_bytes` = `max_context_tokens` x
`bytes_per_context_token` (`generation.server.request_bytes_per_context_token`). The rule behind
the per-token figure: a token of the conversation costs about 4-8 bytes as JSON text, about 22 as
a sent-back log-probability (once, for generated tokens) and 6.8 as a token id in every later
assistant turn's `prompt_token_ids`, since Gym's `vllm_model` adapter sends each earlier turn
back with its whole prompt. An episode whose model calls fill the context therefore posts about
30 + 3.4 x (its model calls) bytes per context token at its last call: the 200-call SWE episode of
`benchmarks/bench_request_parse.py` posts 44.6 MB at 65,847 tokens, 677 bytes a token. The
default, 1024, admits such an episode up to about 290 calls; a server whose clients send no ids
back needs only the text's share (about 16).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fastapi import Request

from gymrl.generation.server.api_error import ApiError
from nemo_gym_ext.json_body import Model, parse_json_body_off_loop

BYTES_PER_TOKEN_KEY = "generation.server.request_bytes_per_context_token"
READ_TIMEOUT_KEY = "generation.server.request_timeout_s"


@dataclass(frozen=True)
class BodyBound:
    """The largest body a chat request may have, by the context it must fit."""

    max_context_tokens: int
    bytes_per_context_token: int

    def __post_init__(self) -> None:
        if self.bytes_per_context_token < 1:
            raise ValueError(
                f"{BYTES_PER_TOKEN_KEY}={self.bytes_per_context_token} must be >= 1 (bytes of "
                "request body per token of the context)"
            )

    @property
    def max_bytes(self) -> int:
        return self.max_context_tokens * self.bytes_per_context_token

    async def read(self, request: Request, model: type[Model], *, timeout_s: float) -> Model:
        """`request`'s body, read within this bound and `timeout_s`, validated as `model`.

        A refusal is an :class:`ApiError`: 413 over the bound, 408 when the body does not
        arrive in time; an invalid body a `RequestValidationError` naming the field."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            raise self._too_large(int(declared), "declared by its Content-Length")
        try:
            raw = await asyncio.wait_for(self._read_at_most(request), timeout_s)
        except TimeoutError:
            raise ApiError(
                408,
                f"the request body did not arrive within {READ_TIMEOUT_KEY}={timeout_s} s; send "
                "it at once, or raise the server's request timeout",
                error_type="timeout_error",
                param="body",
            ) from None
        return await parse_json_body_off_loop(raw, model)

    async def _read_at_most(self, request: Request) -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_bytes:
                raise self._too_large(size, "read so far (sent without Content-Length)")
            chunks.append(chunk)
        return b"".join(chunks)

    def _too_large(self, size: int, how: str) -> ApiError:
        return ApiError(
            413,
            f"request body: {size} bytes {how} is more than this server accepts, "
            f"{self.max_bytes} bytes = its context of {self.max_context_tokens} tokens x "
            f"{BYTES_PER_TOKEN_KEY}={self.bytes_per_context_token}; a conversation this large "
            "cannot fit the context, so shorten it, or raise "
            f"{BYTES_PER_TOKEN_KEY} if the earlier turns' token ids and log-probabilities "
            "legitimately take more",
            error_type="invalid_request_error",
            param="body",
        )

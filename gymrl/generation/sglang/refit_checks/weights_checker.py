"""Weights checked where they land, the `weights_checker` method: SGLang's own weight checker,
which works for every model class.

`POST /weights_checker {action, allow_quant_error, skip_tensor_list, selector}` of SGLang 0.5.23
(`sglang/srt/utils/weight_checker.py`, routed by `entrypoints/http_server.py`) acts on every
parameter and buffer of a server's ranks, but only attention-TP rank 0 answers
(`scheduler.py` `init_ipc_channels`: the other ranks send nothing back), so a failure on another
rank is not reported: at TP > 1 the compare and the checksum vouch for rank 0's shard only
(docs/cluster.md says so too). Per rank: `snapshot` copies them into host memory,
`reset_tensors` overwrites them with random values, `compare` checks them bit for bit against the
snapshot and then drops it, `checksum` hashes them. It answers `{success, message}`, status 400
when not successful (a failed compare's message is "check tensor equality failed:" and a line per
tensor, `name=... max_abs_err=... mean_abs_err=... num_exceed=...`); a checksum adds `ranks` (one
`ChecksumInfo` per rank) and `per_engine_checksum`, a hash over the ranks' checksums in order.

SGLang's `load_weights` skips a name its model does not know and still reports success, so a
refit can leave tensors behind unnoticed. :class:`WeightsChecker` makes of the facility, per
engine:

* **The first refit of a fresh run** sends weight version 0, the weights of `policy.model` the
  servers started from. Before anything is sent, every server takes a `snapshot` and proves the
  `compare` can run by comparing at once (nothing changed, so only a compare that cannot run
  fails: SGLang 0.5.23's compare moves tensors to CUDA, so it cannot run on a CPU), then takes
  the `snapshot` again and `reset_tensors`; after the refit, `compare`. A compare that cannot
  run stops the refit before any tensor is randomised (:class:`WeightCheckUnavailableError`,
  the servers serve on), and only SGLang's "check tensor equality failed:" is a mismatch. A
  tensor the refit wrote holds its start-up values again; one it did not write is still random,
  and the run stops naming the server and SGLang's message, which names the tensor and its
  errors. The snapshot costs host memory once:
  each GPU rank's weights (Qwen3-30B-A3B at TP 4: about 15 GB per rank), from the snapshot to
  the compare.
* **A later refit that is due** (`generation.refit.verify_every`), and the first refit of a
  resumed run (it sends a checkpoint's weights, which the servers never held, so no snapshot
  can stand for them): `checksum` on every server, whose `per_engine_checksum` must all be
  equal. The servers took the same refit, so one that missed part of it differs. A checksum is
  of each rank's shard, so this needs engines of one parallel layout, which one `generation`
  config gives them. With one engine there is nothing to compare it with, and nothing is asked.

`SGLangEngine.begin_refit` and `end_refit` call it, with generation paused, around whatever sends
the weights: the broadcast and the disk refit take the same pause and resume, so both transports
are checked, and no request runs on the randomised weights. The other method, `read_back`
(`gymrl.generation.sglang.refit_checks.read_back`), reads samples of the broadcast tensors back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from gymrl.config.schema.generation import RefitConfig
from gymrl.generation.sglang.refit_checks.read_back import WeightMismatchError, refit_due

ROUTE = "/weights_checker"
# How SGLang 0.5.23's compare says tensors differ (`utils/weight_checker.py` `_check_tensors`);
# any other failure is a compare that could not run.
MISMATCH_PREFIX = "check tensor equality failed:"
_MESSAGE_CHARS = 2000  # a compare that fails on many tensors answers a line for each

# `SGLangEngine._send`: POST `payload` to `url` + `route` within `timeout_s`.
Post = Callable[[str, str, Mapping[str, Any] | None, float | None], Awaitable[httpx.Response]]


def checker_for(refit: RefitConfig) -> WeightsChecker | None:
    """The engine's check that `generation.refit` asks for: None unless `verify_weights` with
    `verify_method: weights_checker`."""
    if not refit.verify_weights or refit.verify_method != "weights_checker":
        return None
    return WeightsChecker(
        every=refit.verify_every, timeout_s=refit.timeout_s, skip_tensors=refit.verify_skip_tensors
    )


class WeightCheckUnavailableError(WeightMismatchError):
    """The check could not run on a server, before any of its tensors was changed."""


@dataclass
class WeightsChecker:
    """Which `/weights_checker` actions each refit of one engine gets, and what the answers mean.

    Every call has the deadline `timeout_s` (`generation.refit.timeout_s`)."""

    every: int
    timeout_s: float
    skip_tensors: tuple[str, ...] = ()
    _refits: int = field(default=0, init=False)  # refits finished
    _comparing: bool = field(default=False, init=False)  # snapshot taken, tensors reset

    @property
    def bound_s(self) -> float:
        """The longest one of the two hooks takes: at most two calls in a row per server."""
        return 2 * self.timeout_s + 5.0

    async def before_refit(
        self, post: Post, urls: Sequence[str], *, resends_held_weights: bool
    ) -> None:
        """Generation paused, nothing sent yet: at the first refit, when it sends the weights
        the servers hold (`resends_held_weights`: the version they started with), snapshot every
        server, prove the compare runs, snapshot again, then randomise every tensor."""
        if self._refits > 0 or not resends_held_weights:
            return
        await self._on_all(post, urls, "snapshot")
        await self._on_all(post, urls, "compare", probe=True)  # drops the snapshot it passes
        await self._on_all(post, urls, "snapshot")
        self._comparing = True  # from here on the servers' weights are not the ones they served
        await self._on_all(post, urls, "reset_tensors")

    async def after_refit(self, post: Post, urls: Sequence[str], version: int) -> None:
        """The refit to `version` loaded on every server, generation still paused: compare with
        the snapshot, or, when due, the servers' checksums with each other."""
        index = self._refits
        self._refits += 1
        if self._comparing:
            self._comparing = False
            await self._on_all(post, urls, "compare", version)
        elif len(urls) > 1 and refit_due(index, self.every):
            answers = await self._on_all(post, urls, "checksum", version)
            _require_one_checksum(urls, answers, version)

    async def _on_all(
        self,
        post: Post,
        urls: Sequence[str],
        action: str,
        version: int | None = None,
        *,
        probe: bool = False,
    ) -> list[dict[str, Any]]:
        calls = (self._call(post, url, action, version, probe) for url in urls)
        return list(await asyncio.gather(*calls))

    async def _call(
        self, post: Post, url: str, action: str, version: int | None, probe: bool
    ) -> dict[str, Any]:
        body = {"action": action, "skip_tensor_list": list(self.skip_tensors) or None}
        response = await post(url, ROUTE, body, self.timeout_s)
        try:
            answer = orjson.loads(response.content)
        except orjson.JSONDecodeError:
            answer = None
        if not isinstance(answer, dict):
            answer = {}
        if response.status_code == 200 and answer.get("success"):
            return answer
        message = answer.get("message")
        message = repr(response.text[:300]) if message is None else str(message)[:_MESSAGE_CHARS]
        said = f"POST {ROUTE} {action} answered {response.status_code}: {message}"
        if probe:
            raise WeightCheckUnavailableError(
                f"SGLang server {url}: the weight check cannot run there ({said}); its weights "
                "are untouched and it serves on. SGLang 0.5.23's compare needs CUDA: on a CPU "
                "set generation.refit.verify_method=read_back (Llama-family models) or "
                "verify_weights=false"
            )
        raise _refusal(url, action, said, version, mismatch=message.startswith(MISMATCH_PREFIX))


def _refusal(
    url: str, action: str, said: str, version: int | None, *, mismatch: bool
) -> WeightMismatchError:
    """The error for a server that answered `action` unsuccessfully (`said`); `mismatch`: its
    message says tensors differ."""
    if action == "compare" and mismatch:
        return WeightMismatchError(
            f"SGLang server {url} does not hold the weights it started with after refit "
            f"{version}, which sent those weights ({said}). Every tensor was randomised before "
            "the refit, so one that differs was not written by it: SGLang's load_weights "
            "skipped its name (the trainer's export renames it or leaves it out), or the tensor "
            "is not in any checkpoint (then list it in generation.refit.verify_skip_tensors): "
            "stopping the run"
        )
    consequence = (
        "its tensors may be partly random now: stopping the run"
        if action in ("reset_tensors", "compare")
        else "set generation.refit.verify_weights=false to run unchecked"
    )
    return WeightMismatchError(
        f"SGLang server {url}: the weight check could not run ({said}); {consequence}"
    )


def _require_one_checksum(
    urls: Sequence[str], answers: Sequence[Mapping[str, Any]], version: int
) -> None:
    """Every server answered the same `per_engine_checksum`; else the error groups them."""
    servers: dict[str, list[str]] = {}
    for url, answer in zip(urls, answers, strict=True):
        checksum = answer.get("per_engine_checksum")
        if not isinstance(checksum, str):
            raise WeightMismatchError(
                f"SGLang server {url}: POST {ROUTE} checksum answered no per_engine_checksum: "
                f"{str(answer)[:300]}"
            )
        servers.setdefault(checksum, []).append(url)
    if len(servers) > 1:
        groups = sorted(servers.items(), key=lambda group: (-len(group[1]), group[0]))
        listed = "; ".join(f"{checksum} on {', '.join(held)}" for checksum, held in groups)
        raise WeightMismatchError(
            f"the SGLang servers hold different weights after refit {version}, which sent the "
            f"same weights to each: per_engine_checksum {listed}. A server whose checksum is not "
            "the others' missed (part of) the update: stopping the run"
        )

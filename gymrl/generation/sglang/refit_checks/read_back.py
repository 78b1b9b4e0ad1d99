"""Weights checked where they land, the `read_back` method: samples of what the trainer sent,
read back from SGLang.

SGLang's `load_weights` skips a name it does not know and still reports success
(`sglang/srt/models/qwen3_moe.py` of 0.5.23), so an export whose names drift from the server's
model refits "successfully" while the servers keep their old weights. After a refit that is due
(:meth:`ReadBackCheck.samples`), the first and the last tensor of each kind that was sent
(embedding, attention, MoE expert, router, norm, output layer) are read back from every server
with `POST /get_weights_by_name {name, truncate_size}`, which answers the parameter's first
`truncate_size` rows as float32 lists, and compared with the same rows of the sent tensor, cast
to the dtype the server holds. A mismatch, or a tensor the server cannot find, stops the run
naming the server, the tensor and both checksums.

SGLang 0.5.23 implements `/get_weights_by_name` only for some model classes (Llama, Granite, OPT,
Exaone4, EmbeddingGemma2; not Qwen2/Qwen3 nor their MoE variants): for the others every read
fails, and the check says so and names the method that works for them,
`generation.refit.verify_method: weights_checker`
(`gymrl.generation.sglang.refit_checks.weights_checker`, the default). Samples are taken from the
broadcast, so this method checks `transport: nccl` refits only.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
import orjson
import torch

# The first matching pattern names a tensor's kind (Hugging Face names).
TENSOR_KINDS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("embedding", re.compile(r"embed_tokens\.weight$")),
    ("output_layer", re.compile(r"^lm_head\.weight$")),
    ("moe_expert", re.compile(r"\.experts\.\d+\.")),
    ("router", re.compile(r"\.mlp\.gate\.weight$")),
    ("attention", re.compile(r"\.self_attn\.")),
    ("norm", re.compile(r"norm\.weight$")),
)


class WeightMismatchError(RuntimeError):
    """A server holds other values than the trainer sent, or a check of them could not run."""


def refit_due(refit_index: int, every: int) -> bool:
    """Whether refit number `refit_index` (0 = the first) is checked: the first, then every
    `every`-th after it (`generation.refit.verify_every`; 0: the first only)."""
    return refit_index == 0 or (every > 0 and refit_index % every == 0)


def tensor_kind(name: str) -> str | None:
    for kind, pattern in TENSOR_KINDS:
        if pattern.search(name):
            return kind
    return None


def checksum(values: torch.Tensor) -> str:
    """A short digest of float32 values (the form `/get_weights_by_name` answers in)."""
    data = values.detach().to(torch.float32).contiguous().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


@dataclass
class WeightSamples:
    """What one refit sent of each tensor kind: first and last tensor, their leading rows."""

    rows: int
    served_dtype: torch.dtype | None
    first: dict[str, tuple[str, torch.Tensor]] = field(default_factory=dict)
    last: dict[str, tuple[str, torch.Tensor]] = field(default_factory=dict)

    def offer(self, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
        for name, tensor in zip(names, tensors, strict=True):
            kind = tensor_kind(name)
            if kind is None:
                continue
            head = tensor.detach()[: self.rows]
            if self.served_dtype is not None:
                head = head.to(self.served_dtype)
            kept = (name, head.to("cpu", torch.float32).clone())
            self.first.setdefault(kind, kept)
            if self.first[kind][0] != name:
                self.last[kind] = kept

    def chosen(self) -> list[tuple[str, torch.Tensor]]:
        return [*self.first.values(), *self.last.values()]


@dataclass(frozen=True)
class ReadBackCheck:
    """When to read weights back (`generation.refit.verify_weights`, `verify_every`) and how."""

    every: int  # 0: the first refit only; n: the first and every n-th after it
    rows: int  # leading rows read back per tensor (`truncate_size`)
    served_dtype: torch.dtype | None  # the servers' dtype; None: as sent
    timeout_s: float

    def samples(self, refit_index: int) -> WeightSamples | None:
        """A collector for refit number `refit_index` (0 = the first), or None if not due."""
        return (
            WeightSamples(self.rows, self.served_dtype)
            if refit_due(refit_index, self.every)
            else None
        )

    def verify(self, client: httpx.Client, urls: Sequence[str], samples: WeightSamples) -> None:
        for url in urls:
            for name, sent in samples.chosen():
                held = self._read(client, url, name)
                if held.shape != sent.shape or not torch.equal(held, sent):
                    raise WeightMismatchError(
                        f"SGLang server {url} holds other values for {name!r} than the trainer "
                        f"sent: first {self.rows} rows, checksum sent {checksum(sent)} "
                        f"(shape {list(sent.shape)}), held {checksum(held)} (shape "
                        f"{list(held.shape)}); the server skipped or misloaded it (a name its "
                        "model does not know, or another dtype or layout): stopping the run"
                    )

    def _read(self, client: httpx.Client, url: str, name: str) -> torch.Tensor:
        try:
            response = client.post(
                f"{url}/get_weights_by_name",
                content=orjson.dumps({"name": name, "truncate_size": self.rows}),
                headers={"content-type": "application/json"},
                timeout=self.timeout_s,
            )
        except httpx.HTTPError as error:
            raise WeightMismatchError(
                f"SGLang server {url}: reading {name!r} back failed: {type(error).__name__}: "
                f"{error}"
            ) from error
        if response.status_code != 200:
            raise WeightMismatchError(
                f"SGLang server {url} cannot show {name!r} (POST /get_weights_by_name answered "
                f"{response.status_code}: {response.text[:300]!r}): it does not hold a tensor of "
                "that name, or its model class has no get_weights_by_name (SGLang 0.5.23: only "
                "Llama, Granite, OPT, Exaone4, EmbeddingGemma2); for such models set "
                "generation.refit.verify_method=weights_checker"
            )
        return torch.tensor(orjson.loads(response.content), dtype=torch.float32)

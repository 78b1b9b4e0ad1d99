"""A generation engine in plain torch for CPUs and small GPUs: continuous batching on a KV cache.

It drives a Hugging Face causal LM step by step instead of calling `generate`, because the trainer
needs what `generate` does not give cheaply: per-request seeds and sampling parameters, the
log-probability of every sampled token under the temperature-scaled distribution, weight refits
between calls, and no compute spent on finished rows or on padding.

How requests run:

- The engine schedules requests itself (a `RequestScheduler`): `submit` queues one and returns a
  future; one loop thread decodes up to `max_batch_size` rows at once, admits queued requests
  into free slots at every step, and answers each row the moment it finishes (continuous
  batching across callers). In a multi-turn run an agent's next turn therefore joins the batch
  while other episodes are still generating, instead of waiting for a whole batch to end.
- Admitted prompts are prefilled *packed*: concatenated into one sequence with a block-diagonal
  causal mask and per-prompt position ids, so no padding is computed and the matrix products stay
  large. Logits are computed only at each prompt's last position.
- Decoding keeps every row's cache right-aligned in one buffer (left padding, masked out, with
  explicit position ids). Whenever rows finish or arrive the buffer is rebuilt: finished rows are
  dropped, and columns that are padding in every remaining row are cut off.
- Keys and values are written into spare capacity instead of being concatenated, so a decoding
  step copies only the new token's keys and values, not the whole cache.
- A finished row's keys and values are kept (`gymrl.generation.torch.prefix_cache`): a later prompt
  that starts with the same tokens (the episode's next turn, or any episode of the same task's
  system prompt) prefills only what follows the shared prefix, attending to the kept part.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer

from gymrl.config.schema.generation import TorchGenerationConfig
from gymrl.generation.torch.llama_decode import LlamaDecoder, unsupported_reason
from gymrl.generation.torch.prefix_cache import CachedPrefix, PrefixCache, plan_prefill
from gymrl.generation.types import (
    EngineFailedError,
    EngineUnavailableError,
    FinishReason,
    GenerationOutput,
    GenerationRequest,
    SamplingParams,
)
from gymrl.model.attention_mask import additive_mask
from gymrl.model.precision import (
    ComputeDtype,
    body_autocast,
    resolve_compute_dtype,
    round_body_matmul_weights,
)
from gymrl.run.adapter import AdapterWeights

_SEED_BOUND = 2**62
# Spare columns a decode batch's cache keeps for the tokens to come. The fused decode step attends
# over the whole buffer, spare room included (masked), so room costs attention at every step;
# a batch that fills it grows by as much again, copying its cache once per that many steps.
_DECODE_ROOM = 64

log = logging.getLogger(__name__)

DecodePath = Literal["auto", "fused", "transformers"]


class _BufferedLayer(DynamicLayer):
    """One layer's keys and values `[batch, kv_heads, length, head_dim]`, with spare room.

    transformers' DynamicLayer appends with `torch.cat`, which copies the whole cache at every
    decoding step; here a step writes only the new columns into capacity reserved in advance.
    `keys`/`values` are views of the filled part, which is what the attention code reads.
    """

    def __init__(
        self,
        key_buffer: torch.Tensor | None = None,
        value_buffer: torch.Tensor | None = None,
        length: int = 0,
        dtype: torch.dtype | None = None,
    ) -> None:
        """`dtype`: what an empty layer stores its first keys and values in (None: theirs)."""
        super().__init__()
        self._key_buffer = key_buffer
        self._value_buffer = value_buffer
        self._length = length
        self._dtype = dtype
        if key_buffer is not None:
            self._expose()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._key_buffer is None or self._value_buffer is None:
            self._key_buffer = key_states.to(self._dtype or key_states.dtype)
            self._value_buffer = value_states.to(self._dtype or value_states.dtype)
            self._length = key_states.shape[-2]
        else:
            end = self._length + key_states.shape[-2]
            self.reserve(key_states.shape[-2])
            assert self._key_buffer is not None and self._value_buffer is not None
            self._key_buffer[:, :, self._length : end] = key_states
            self._value_buffer[:, :, self._length : end] = value_states
            self._length = end
        return self._expose()

    def reserve(self, columns: int) -> None:
        """Make sure `columns` more tokens fit: a full buffer is copied into one with that many
        columns more and `_DECODE_ROOM` spare (zeros) after them."""
        if self._key_buffer is None or self._value_buffer is None:
            return  # an empty layer takes its first keys and values as they come
        end = self._length + columns
        if end > self._key_buffer.shape[-2]:
            capacity = end + _DECODE_ROOM
            self._key_buffer = _grown(self._key_buffer, self._length, capacity)
            self._value_buffer = _grown(self._value_buffer, self._length, capacity)

    def cached(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values cached so far; the base class types `keys`/`values` as optional."""
        if self._key_buffer is None or self._value_buffer is None:
            raise RuntimeError("this cache layer was read before the model wrote to it")
        return self._key_buffer[:, :, : self._length], self._value_buffer[:, :, : self._length]

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole key and value buffers, spare capacity included: dense tensors, which the
        matrix products of the fused decode step read without copying (a view of the filled
        part is not). A decode batch's padding and spare capacity hold zeros
        (`_DecodeBatch.rebuild`)."""
        if self._key_buffer is None or self._value_buffer is None:
            raise RuntimeError("this cache layer was read before the model wrote to it")
        return self._key_buffer, self._value_buffer

    def _expose(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Point `keys`/`values` (what the attention code reads) at the filled part."""
        self.keys, self.values = keys, values = self.cached()
        self.device = keys.device
        self.is_initialized = True
        return keys, values


def _grown(buffer: torch.Tensor, filled: int, capacity: int) -> torch.Tensor:
    """A copy of `buffer`'s first `filled` columns in a buffer of `capacity` columns."""
    batch, heads, _, dim = buffer.shape
    bigger = buffer.new_zeros(batch, heads, capacity, dim)
    bigger[:, :, :filled] = buffer[:, :, :filled]
    return bigger


@dataclass(frozen=True)
class EngineCounters:
    """Totals since the engine started, to tell where rollout time goes: seconds the loop spent
    computing (prefill and decode) rather than waiting for requests, decode steps and the rows
    they held (`decode_rows / decode_steps` is the mean batch occupancy), prompt tokens
    prefilled (computed), prompt tokens whose keys and values came from the prefix cache
    instead, and tokens generated."""

    busy_s: float = 0.0
    decode_steps: int = 0
    decode_rows: int = 0
    prefill_tokens: int = 0
    reused_tokens: int = 0
    generated_tokens: int = 0


@dataclass(frozen=True)
class EngineStep:
    """One iteration of the engine's loop, for a timeline: when it ran (`time.monotonic()`, one
    clock for every process of a machine), the rows it admitted (prefilled) and decoded, the
    requests queued when it ended (with a batch short of `max_batch_size`, none: the batch was
    short for want of requests), the rows it answered, and the seconds of its three
    phases: the prefill of the admitted rows, the re-packing of the batch's cache when rows
    joined or left it (`_DecodeBatch.rebuild`), and the decode step. What a pass waits on is
    read from these (`benchmarks/bench_rollout_timeline.py`)."""

    start_s: float
    end_s: float
    admitted: int
    decoded_rows: int
    waiting: int
    answered: int
    prefill_s: float
    rebuild_s: float
    decode_s: float


class EngineClosedError(EngineUnavailableError):
    """A request reached the engine after `close()`, or was still waiting when it closed."""


@dataclass
class _Row:
    """One request being served: its sampling state, what it has generated so far, and the
    future its caller waits on."""

    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    generator: torch.Generator
    future: Future[GenerationOutput]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    reused: int = 0  # leading prompt tokens whose keys/values came from the prefix cache

    def add(self, token: int, logprob: float) -> None:
        """Record a sampled token and whether it finishes the row."""
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        if token in self.stop_ids:
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.params.max_new_tokens:
            self.finish_reason = "length"

    @property
    def cached(self) -> int:
        """Tokens in this row's KV cache: the prompt and every sampled token but the last."""
        return len(self.prompt) + len(self.token_ids) - 1

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.token_ids)


@dataclass
class _Arrival:
    """A freshly prefilled row: its per-layer keys/values `[kv_heads, prompt_len, head_dim]`."""

    row: _Row
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


class _DecodeBatch:
    """The rows decoding together and their right-aligned KV cache.

    Each layer's keys and values live in a buffer with a slot per row the engine may decode at
    once (`[slots, kv_heads, capacity, head_dim]`); the rows decoding hold the first slots, and
    each layer's cache is a view of them (a leading slice: dense, as the fused step needs).
    Rows joining and leaving move only their own slots where they can (`rebuild`): re-packing
    the whole cache copies every row's keys and values, more memory traffic than a decode
    step, at every turn boundary (benchmarks/README.md, "Validation against TRL on slow memory").
    """

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.rows: list[_Row] = []
        self.layers: list[_BufferedLayer] = []
        self._keys: list[torch.Tensor] = []  # per layer, [slots, kv_heads, capacity, head_dim]
        self._values: list[torch.Tensor] = []

    @property
    def width(self) -> int:
        return self.layers[0].get_seq_length() if self.layers else 0

    @property
    def capacity(self) -> int:
        return self._keys[0].shape[-2] if self.layers else 0

    def reserve(self, columns: int) -> None:
        """Make room for `columns` more tokens: full buffers are copied into ones with that many
        columns more and `_DECODE_ROOM` spare (zeros) after them."""
        width = self.width
        if not self.layers or width + columns <= self.capacity:
            return
        capacity = width + columns + _DECODE_ROOM
        rows = len(self.rows)
        for buffers in (self._keys, self._values):
            for layer, buffer in enumerate(buffers):
                slots, heads, _, dim = buffer.shape
                bigger = buffer.new_empty(slots, heads, capacity, dim)
                bigger[:rows, :, :width] = buffer[:rows, :, :width]
                bigger[:rows, :, width:].zero_()
                buffers[layer] = bigger
        self._link(width)

    def rebuild(self, keep: Sequence[int], arrivals: Sequence[_Arrival]) -> None:
        """Keep rows `keep` (ascending indices into `self.rows`) and append `arrivals`.

        In place when rows are kept and every row fits the cache's width with at most
        `_DECODE_ROOM` columns that are padding in every row (a batch that starts afresh is laid
        out afresh, as a new engine's would be): the kept rows past the new row count move into the
        slots of the rows that left (whole slots), and each arrival is written into a free slot
        right-aligned, its padding and room zeroed. Otherwise `_repack`. A free slot holds
        whatever it held: every row written into one fills or zeroes all of its columns, so
        attention reads (masked) finite numbers only."""
        kept = [self.rows[i] for i in keep]
        rows = kept + [arrival.row for arrival in arrivals]
        if not rows:
            self.rows, self.layers, self._keys, self._values = [], [], [], []
            return
        width = self.width
        longest = max(row.cached for row in rows)
        if not keep or not width - _DECODE_ROOM <= longest <= width:
            self._repack(keep, arrivals)
            return
        kept_set = set(keep)
        holes = [i for i in range(len(keep)) if i not in kept_set]
        movers = [i for i in keep if i >= len(keep)]
        if holes:
            into = torch.tensor(holes, device=self._keys[0].device)
            out_of = torch.tensor(movers, device=self._keys[0].device)
            for buffer in (*self._keys, *self._values):
                buffer.index_copy_(0, into, buffer.index_select(0, out_of))
        order = list(range(len(keep)))
        for hole, mover in zip(holes, movers, strict=True):
            order[hole] = mover
        for slot, arrival in enumerate(arrivals, start=len(keep)):
            for buffers, segments in ((self._keys, arrival.keys), (self._values, arrival.values)):
                for buffer, segment in zip(buffers, segments, strict=True):
                    start = width - segment.shape[-2]
                    buffer[slot, :, :start].zero_()
                    buffer[slot, :, start:width] = segment
                    buffer[slot, :, width:].zero_()
        self.rows = [self.rows[i] for i in order] + [arrival.row for arrival in arrivals]
        self._link(width)

    def _repack(self, keep: Sequence[int], arrivals: Sequence[_Arrival]) -> None:
        """Copy the kept rows and the arrivals into new buffers as wide as the longest row
        (columns that are padding in every row are dropped), with room for the most tokens any
        row may still add, up to `_DECODE_ROOM` (then it grows by as much again); padding and
        room hold zeros, so attention may read them (masked) as finite numbers."""
        kept = [self.rows[i] for i in keep]
        rows = kept + [arrival.row for arrival in arrivals]
        width = max(row.cached for row in rows)
        shortest = min(row.cached for row in rows)
        capacity = width + min(_DECODE_ROOM, max(row.remaining for row in rows))
        kept_width = max((row.cached for row in kept), default=0)
        old_width = self.width
        keep_index = torch.tensor(list(keep), dtype=torch.long)
        depth = len(self._keys) if self._keys else len(arrivals[0].keys)
        repacked: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for name, old_buffers, new_buffers in (
            ("keys", self._keys, repacked[0]),
            ("values", self._values, repacked[1]),
        ):
            for layer in range(depth):
                template = old_buffers[layer] if kept else getattr(arrivals[0], name)[layer]
                heads, dim = template.shape[-3], template.shape[-1]
                buffer = template.new_empty(self.slots, heads, capacity, dim)
                buffer[: len(rows), :, : width - shortest].zero_()
                buffer[: len(rows), :, width:].zero_()
                if kept:
                    old = old_buffers[layer]
                    buffer[: len(kept), :, width - kept_width : width] = old[
                        keep_index.to(old.device), :, old_width - kept_width : old_width
                    ]
                for slot, arrival in enumerate(arrivals, start=len(kept)):
                    segment = getattr(arrival, name)[layer]
                    buffer[slot, :, width - segment.shape[-2] : width] = segment
                new_buffers.append(buffer)
        self._keys, self._values = repacked
        self.rows = rows
        self._link(width)

    def _link(self, width: int) -> None:
        """Point each layer's cache at the slots of the rows decoding, `width` columns filled."""
        rows = len(self.rows)
        self.layers = [
            _BufferedLayer(keys[:rows], values[:rows], width)
            for keys, values in zip(self._keys, self._values, strict=True)
        ]


def _fail(future: Future[GenerationOutput], error: BaseException) -> None:
    """Fail `future` unless it is answered or its caller cancelled it."""
    if future.done():
        return
    if future.running() or future.set_running_or_notify_cancel():
        future.set_exception(error)


@dataclass(frozen=True)
class _Admission:
    """A row to prefill and the cached prefix of its prompt, if any: only the rest is computed."""

    row: _Row
    prefix: CachedPrefix | None

    @property
    def reused(self) -> int:
        return self.prefix.length if self.prefix else 0

    @property
    def fresh(self) -> list[int]:
        return self.row.prompt[self.reused :]


def _prefill_chunks(
    admissions: Sequence[_Admission], token_budget: int
) -> Iterator[list[_Admission]]:
    """Consecutive admissions whose tokens to compute together fit `token_budget` (a longer
    one alone)."""
    chunk: list[_Admission] = []
    tokens = 0
    for admission in admissions:
        size = len(admission.row.prompt) - admission.reused
        if chunk and tokens + size > token_budget:
            yield chunk
            chunk, tokens = [], 0
        chunk.append(admission)
        tokens += size
    if chunk:
        yield chunk


def _pick(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one index per row of non-negative `weights`, from one uniform each.

    One uniform per row (rather than `torch.multinomial`'s one random number per vocabulary entry)
    keeps sampling cheap and makes each row's draw depend only on its own generator.
    """
    cdf = weights.cumsum(dim=-1)
    targets = (uniforms * cdf[:, -1]).unsqueeze(1)
    picked = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    # Rounding can push a target onto the total, past the end: take the last entry with weight.
    overflow = (picked == weights.shape[-1]).nonzero().squeeze(1)
    if overflow.numel():
        positive = (weights[overflow] > 0).flip(-1).to(torch.int8)
        picked[overflow] = weights.shape[-1] - 1 - positive.argmax(dim=-1)
    return picked


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of `logits` `[batch, vocab]`; return (tokens, log-probabilities).

    A row with temperature 0 is greedy and its log-probability is under the untempered softmax.
    Otherwise the log-probability is under the temperature-scaled softmax before top-p truncation
    (what the trainer recomputes), and the token is drawn from the smallest set of most likely
    tokens whose mass reaches `top_p`, using the row's uniform in [0, 1). Computed in fp32.
    """
    greedy = temperature == 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits.float()
    if not bool((scale == 1).all()):
        scaled = scaled / scale.unsqueeze(1)
    logprobs = torch.log_softmax(scaled, dim=-1)
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    greedy_rows = greedy.nonzero().squeeze(1)
    if greedy_rows.numel():
        tokens[greedy_rows] = scaled[greedy_rows].argmax(dim=-1)
    sampled = (~greedy).nonzero().squeeze(1)
    if sampled.numel():
        # Indexing copies; skip it in the common case where every row samples.
        rows = sampled if greedy_rows.numel() else slice(None)
        probs = logprobs[rows].exp()
        row_top_p, row_uniforms = top_p[rows], uniforms[rows]
        truncating = row_top_p < 1
        if bool(truncating.any()):
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            outside = (mass_before >= row_top_p.unsqueeze(1)) & truncating.unsqueeze(1)
            picked = _pick(sorted_probs.masked_fill(outside, 0.0), row_uniforms)
            tokens[rows] = order.gather(1, picked.unsqueeze(1)).squeeze(1)
        else:
            tokens[rows] = _pick(probs, row_uniforms)
    return tokens, logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)


class TorchGenerationEngine:
    """Token-in/token-out generation on a Hugging Face causal LM; a `GenerationEngine` that
    schedules its requests itself (`RequestScheduler`).

    The engine owns `model`: it is switched to eval mode, its body's matmul weights are stored in
    the compute dtype when that is not the weights' own (`round_body_matmul_weights`), and its
    weights are replaced in place by `update_weights`. A refit never lands in the middle of a
    generation: it stops admitting queued requests, waits for the rows in flight to finish, then
    loads, so every output carries the one weight version it was generated with. Safe to call
    from any thread.

    A step that raises stops the engine for good (`failure()`, `EngineFailedError`): the rows it
    held may have advanced in some layers' caches and not in others, so nothing in flight can be
    resumed, and an error of the step itself (not of a request, which `submit` refuses first)
    would come back on the next batch; restarting would turn one clear error into a run that
    fails episode after episode.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        max_batch_size: int,
        eos_token_ids: Iterable[int],
        seed: int,
        prefill_token_budget: int,
        prefix_cache_tokens: int,
        compute_dtype: ComputeDtype,
        decode_path: DecodePath,
    ) -> None:
        """`eos_token_ids` end every request (on top of each request's own stop tokens); `seed`
        seeds the generator that draws a seed for every request that brings none;
        `prefill_token_budget` bounds how many prompt tokens are packed into one prefill pass
        (its mask is quadratic in that number); `prefix_cache_tokens` bounds the finished rows'
        tokens whose keys and values are kept for reuse (0: none); `compute_dtype` is
        `policy.compute_dtype` (`gymrl.model.precision`: the body under autocast, logits in the
        weights' dtype); `decode_path` is `generation.decode_path`: `fused` decodes through
        `gymrl.generation.torch.llama_decode` (Llama models only; another model is refused), `auto`
        does where the model allows and says so, `transformers` (the reference the fused step is
        tested against) calls the model itself at every step. The weights are version 0 until
        `update_weights`."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if prefill_token_budget < 1:
            raise ValueError(f"prefill_token_budget must be >= 1, got {prefill_token_budget}")
        layer_types = getattr(model.config.get_text_config(), "layer_types", None) or []
        if any(kind != "full_attention" for kind in layer_types):
            raise ValueError(
                f"TorchGenerationEngine supports full-attention models only; this model's "
                f"layer_types are {sorted(set(layer_types))}"
            )
        self._model = model.eval()
        self._max_batch_size = max_batch_size
        self._eos_ids = frozenset(int(token) for token in eos_token_ids)
        self._prefill_token_budget = prefill_token_budget
        self._prefix_cache = PrefixCache(prefix_cache_tokens)
        embeddings = model.get_input_embeddings()
        if not isinstance(embeddings, torch.nn.Embedding):
            raise ValueError(
                f"TorchGenerationEngine needs a token embedding (torch.nn.Embedding) as the "
                f"model's input layer; this model's is {type(embeddings).__name__}"
            )
        self._vocab_size = embeddings.num_embeddings
        self._num_layers = model.config.get_text_config().num_hidden_layers
        self._device = next(model.parameters()).device
        self._dtype = next(model.parameters()).dtype
        self._compute_dtype = resolve_compute_dtype(compute_dtype, self._device)
        # Keys and values are kept in the dtype attention reads them in (under bfloat16 autocast
        # the rotated keys come out float32, and autocast rounds them again at every step).
        self._cache_dtype = self._compute_dtype or self._dtype
        round_body_matmul_weights(model, self._compute_dtype)
        self._decoder = self._fused_decoder(model, decode_path)
        output_layer = model.get_output_embeddings()
        if output_layer is None:
            raise ValueError(f"{type(model).__name__} has no output layer (lm_head) to sample from")
        self._output_layer = output_layer
        # transformers renamed `past_key_values` to `cache` in 5.x; use whichever this one takes.
        parameters = inspect.signature(model.forward).parameters
        self._cache_argument = "cache" if "cache" in parameters else "past_key_values"
        self._seed_source = torch.Generator().manual_seed(seed)
        self._version = 0
        # The weights a LoRA adapter is merged into, per adapted module, as they were before the
        # first adapter touched them (`update_adapter`); a full refit replaces them.
        self._adapter_base: dict[str, torch.Tensor] = {}
        # `_model_lock` guards the model (a decode step, a refit). `_schedule` guards the queue,
        # the count of rows admitted and not yet answered, and the refits waiting for them to
        # drain; it is never held while taking `_model_lock`.
        self._model_lock = threading.Lock()
        self._schedule = threading.Condition()
        self._waiting: deque[_Row] = deque()
        self._in_flight = 0
        self._refits_waiting = 0
        self._closed = False
        self._failure: EngineFailedError | None = None  # why a failed step stopped the loop
        self._loop: threading.Thread | None = None
        self._counters = EngineCounters()  # replaced whole under `_schedule`, read from any thread
        self._timeline: list[EngineStep] | None = None  # recorded only when asked for

    @classmethod
    def from_config(
        cls,
        model: PreTrainedModel,
        generation: TorchGenerationConfig,
        *,
        seed: int,
        compute_dtype: ComputeDtype,
        eos_token_ids: Iterable[int] = (),
    ) -> TorchGenerationEngine:
        """An engine on `model` with `generation`'s batch size, prefill budget, prefix cache and
        decode path; `seed` (`run.seed`) and `compute_dtype` (`policy.compute_dtype`) live
        outside `generation.*`, so the caller hands them over."""
        return cls(
            model,
            max_batch_size=generation.max_batch_size,
            eos_token_ids=eos_token_ids,
            seed=seed,
            prefill_token_budget=generation.prefill_token_budget,
            prefix_cache_tokens=generation.prefix_cache_tokens,
            compute_dtype=compute_dtype,
            decode_path=generation.decode_path,
        )

    def _fused_decoder(self, model: PreTrainedModel, path: DecodePath) -> LlamaDecoder | None:
        """The fused decode step `path` asks for, if any; `fused` refuses a model it cannot
        decode, `auto` falls back to the model's own forward and logs why."""
        if path == "transformers":
            return None
        reason = unsupported_reason(model)
        if reason is None:
            return LlamaDecoder(model, self._compute_dtype, self._max_batch_size)
        if path == "fused":
            raise ValueError(
                f"generation.decode_path=fused cannot decode {type(model).__name__}: {reason}; "
                "set generation.decode_path=auto (or transformers) to decode through the model"
            )
        log.info(
            "torch engine: decoding through %s's own forward (%s)", type(model).__name__, reason
        )
        return None

    @property
    def decode_path(self) -> Literal["fused", "transformers"]:
        """The decode step this engine runs."""
        return "transformers" if self._decoder is None else "fused"

    @property
    def weight_version(self) -> int:
        return self._version

    def counters(self) -> EngineCounters:
        with self._schedule:
            return self._counters

    def failure(self) -> EngineFailedError | None:
        """Why a failed step stopped the engine for good; None while it serves or after a plain
        `close()`."""
        with self._schedule:
            return self._failure

    def record_timeline(self) -> None:
        """Start recording every loop iteration (`EngineStep`), forgetting an earlier record."""
        with self._schedule:
            self._timeline = []

    def timeline(self) -> list[EngineStep]:
        """The iterations recorded since `record_timeline`; recording stops."""
        with self._schedule:
            steps, self._timeline = self._timeline or [], None
            return steps

    def weight_dtypes(self) -> dict[str, torch.dtype]:
        """The dtype the engine stores each weight in (the body's Linear weights are rounded to
        the compute dtype): a trainer that sends its weights in these moves fewer bytes to the
        same result, since loading rounds them the same way."""
        with self._model_lock:
            return {name: tensor.dtype for name, tensor in self._model.state_dict().items()}

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load `state_dict` into the model in place (strict) and set the weight version, once
        the rows in flight have finished; queued requests start after it with the new weights."""

        def load() -> None:
            self._model.load_state_dict(state_dict, strict=True)
            self._adapter_base.clear()  # the new weights are what later adapters merge into

        self._refit(load, version)

    def update_adapter(self, adapter: AdapterWeights, version: int) -> None:
        """Serve the base weights with `adapter` merged in, as weight version `version`: an
        adapter refit, which moves the adapter's factors instead of every weight.

        Merged into a copy (benchmarks/README.md, "LoRA refit into the torch engine"): the
        weights each adapted module had before its first adapter are kept, and every refit
        writes base + scaling x B @ A (in float32, stored in the weight's dtype) into the module
        in place, so decoding runs exactly as without an adapter (the fused step included)
        instead of adding two low-rank products to every adapted layer at every token. A module
        an earlier adapter adapted and this one does not goes back to its base weight. An
        adapter module the model does not have, or that is not a Linear of its shape, raises
        naming it before any weight changes."""
        pairs = adapter.module_pairs()
        modules = {
            name: module
            for name, module in self._model.named_modules()
            if isinstance(module, torch.nn.Linear)
        }
        unknown = sorted(name for name in pairs if name not in modules)
        if unknown:
            raise ValueError(
                f"adapter modules {unknown[:5]} ({len(unknown)} of {len(pairs)}) are not Linear "
                "modules of the engine's model; the adapter was trained on another model"
            )
        for name, (a, b) in pairs.items():
            weight = modules[name].weight
            if (b.shape[0], a.shape[1]) != weight.shape or a.shape[0] != b.shape[1]:
                raise ValueError(
                    f"adapter module {name!r} has factors A {list(a.shape)} and B "
                    f"{list(b.shape)}; the engine's weight is {list(weight.shape)} (out x in)"
                )

        def merge() -> None:
            for name in pairs.keys() - self._adapter_base.keys():
                self._adapter_base[name] = modules[name].weight.detach().clone()
            for name, base in self._adapter_base.items():
                weight = modules[name].weight
                if name in pairs:
                    weight.copy_(adapter.merged(base, *pairs[name]))  # rounded to its dtype
                else:
                    weight.copy_(base)

        self._refit(merge, version)

    def _refit(self, load: Callable[[], None], version: int) -> None:
        """Run `load` on the model (under no_grad) as weight version `version`, once the rows
        in flight have finished; queued requests start after it with the new weights."""
        self._check_version(version)
        with self._schedule:
            self._refits_waiting += 1
            # Bounded: admission is paused, and every row in flight ends within its
            # max_new_tokens (the caller's own deadline covers a stalled engine).
            while self._in_flight:
                self._schedule.wait()
            if self._failure is not None:
                self._refits_waiting -= 1
                raise self._failure
        try:
            with self._model_lock, torch.no_grad():
                self._check_version(version)
                load()
                if self._decoder is not None:
                    self._decoder.refresh()
                self._prefix_cache.clear()  # computed by the old weights
                self._version = version
        finally:
            with self._schedule:
                self._refits_waiting -= 1
                self._schedule.notify_all()

    def submit(self, request: GenerationRequest) -> Future[GenerationOutput]:
        """Queue `request`; its future resolves when it finishes (an invalid request's at once,
        with the ValueError naming the field). Cancelling it before it is admitted abandons it."""
        return self._enqueue([request])[0]

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        """Generate for a batch of requests, one output per request, in order; invalid requests
        raise before any is queued."""
        for index, request in enumerate(requests):
            self._validate(index, request)
        return [future.result() for future in self._enqueue(requests)]

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the loop after its current step; requests not yet answered fail."""
        with self._schedule:
            self._closed = True
            self._schedule.notify_all()
            loop = self._loop
        if loop is not None:
            loop.join(timeout_s)
            if loop.is_alive():
                raise TimeoutError(f"the torch engine's loop did not stop within {timeout_s} s")

    def _check_version(self, version: int) -> None:
        if version < self._version:
            raise ValueError(
                f"weight version {version} is older than the engine's current version "
                f"{self._version}; refit with a version >= {self._version}"
            )

    def _enqueue(self, requests: Sequence[GenerationRequest]) -> list[Future[GenerationOutput]]:
        """Queue every valid request of `requests` at once (so one call's requests are admitted
        together) and start the loop on first use."""
        futures: list[Future[GenerationOutput]] = []
        with self._schedule:
            for index, request in enumerate(requests):
                future: Future[GenerationOutput] = Future()
                futures.append(future)
                try:
                    if self._closed:
                        raise self._failure or EngineClosedError("the torch engine is closed")
                    self._validate(index, request)
                except (ValueError, EngineClosedError, EngineFailedError) as error:
                    future.set_exception(error)
                    continue
                self._waiting.append(self._new_row(request, future))
            if self._loop is None and not self._closed:
                self._loop = threading.Thread(
                    target=self._run, name="torch-engine-loop", daemon=True
                )
                self._loop.start()
            self._schedule.notify_all()
        return futures

    def _validate(self, index: int, request: GenerationRequest) -> None:
        where = f"requests[{index}]"
        params = request.params
        if len(request.prompt_token_ids) == 0:
            raise ValueError(
                f"{where}.prompt_token_ids is empty; a prompt needs at least one token"
            )
        out_of_range = [t for t in request.prompt_token_ids if not 0 <= t < self._vocab_size]
        if out_of_range:
            raise ValueError(
                f"{where}.prompt_token_ids has ids outside the vocabulary [0, {self._vocab_size}): "
                f"{out_of_range[:5]}"
            )
        if params.max_new_tokens < 1:
            raise ValueError(
                f"{where}.params.max_new_tokens must be >= 1, got {params.max_new_tokens}"
            )
        if params.temperature < 0:
            raise ValueError(
                f"{where}.params.temperature must be >= 0 (0 is greedy), got {params.temperature}"
            )
        if not 0 < params.top_p <= 1:
            raise ValueError(f"{where}.params.top_p must be in (0, 1], got {params.top_p}")
        if params.seed is not None and not 0 <= params.seed < 2**64:
            raise ValueError(
                f"{where}.params.seed must be None or in [0, 2**64), got {params.seed}"
            )

    def _run(self) -> None:
        """The loop: admit queued rows into free slots, prefill them, take one decode step,
        answer the rows that finished; sleep while there is nothing to do. When it ends (closed,
        or a step failed), every request not yet answered fails with the reason; a failed step
        is logged with its traceback and kept as `failure()`."""
        batch = _DecodeBatch(self._max_batch_size)
        keep: list[int] = []  # rows of `batch` still decoding
        admitted: list[_Row] | None = []
        ended: BaseException = EngineClosedError(
            "the torch engine closed before this request finished"
        )
        try:
            while True:
                admitted = self._admit(free=self._max_batch_size - len(keep), decoding=bool(keep))
                if admitted is None:
                    return
                started = time.monotonic()
                with self._model_lock, torch.inference_mode():
                    arrivals = [
                        arrival
                        for arrival in self._prefill(admitted)
                        if not self._answer_if_done(arrival.row)
                    ]
                    prefilled = time.monotonic()
                    if arrivals or len(keep) < len(batch.rows):
                        batch.rebuild(keep, arrivals)
                    rebuilt = time.monotonic()
                    decoding = len(batch.rows)
                    if decoding:
                        self._decode_step(batch)
                        self._keep_finished_caches(batch)
                    keep = [i for i, row in enumerate(batch.rows) if not self._answer_if_done(row)]
                answered = len(admitted) - len(arrivals) + decoding - len(keep)
                self._count(
                    (started, prefilled, rebuilt, time.monotonic()), admitted, decoding, answered
                )
        except Exception as error:
            log.error("torch engine: a step failed; the engine stops", exc_info=error)
            ended = EngineFailedError(
                f"the torch engine stopped after a failed step ({type(error).__name__}: {error}); "
                "every later request fails too: the traceback is in the generation server's log"
            )
            ended.__cause__ = error
        finally:
            with self._schedule:
                self._closed = True
                if isinstance(ended, EngineFailedError):
                    self._failure = ended
                unanswered = [*self._waiting, *(admitted or []), *batch.rows]
                self._waiting.clear()
                self._in_flight = 0
                self._schedule.notify_all()
            for row in unanswered:
                _fail(row.future, ended)

    def _admit(self, *, free: int, decoding: bool) -> list[_Row] | None:
        """Rows to admit now (none while a refit waits); waits while idle; None once closed."""
        with self._schedule:
            while not self._closed and not decoding and not self._admissible():
                self._schedule.wait()
            if self._closed:
                return None
            admitted = []
            while free > len(admitted) and self._admissible():
                row = self._waiting.popleft()
                if row.future.set_running_or_notify_cancel():  # else its caller gave up
                    admitted.append(row)
            self._in_flight += len(admitted)
            return admitted

    def _count(
        self,
        times: tuple[float, float, float, float],
        admitted: Sequence[_Row],
        decoded_rows: int,
        answered: int,
    ) -> None:
        """Add one loop iteration to the counters (each admitted row's prefill sampled its first
        token, each decoded row one more) and to the timeline, if one is recorded; `times` are
        when it started, prefilled, re-packed the batch and ended."""
        start, prefilled, rebuilt, end = times
        with self._schedule:
            if self._timeline is not None:
                self._timeline.append(
                    EngineStep(
                        start_s=start,
                        end_s=end,
                        admitted=len(admitted),
                        decoded_rows=decoded_rows,
                        waiting=len(self._waiting),
                        answered=answered,
                        prefill_s=prefilled - start,
                        rebuild_s=rebuilt - prefilled,
                        decode_s=end - rebuilt,
                    )
                )
            c = self._counters
            self._counters = EngineCounters(
                busy_s=c.busy_s + end - start,
                decode_steps=c.decode_steps + bool(decoded_rows),
                decode_rows=c.decode_rows + decoded_rows,
                prefill_tokens=c.prefill_tokens
                + sum(len(row.prompt) - row.reused for row in admitted),
                reused_tokens=c.reused_tokens + sum(row.reused for row in admitted),
                generated_tokens=c.generated_tokens + len(admitted) + decoded_rows,
            )

    def _admissible(self) -> bool:
        return bool(self._waiting) and not self._refits_waiting

    def _new_row(self, request: GenerationRequest, future: Future[GenerationOutput]) -> _Row:
        params = request.params
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(_SEED_BOUND, (), generator=self._seed_source))
        return _Row(
            prompt=list(request.prompt_token_ids),
            params=params,
            stop_ids=self._eos_ids | frozenset(params.stop_token_ids),
            generator=torch.Generator().manual_seed(seed),
            future=future,
        )

    def _answer_if_done(self, row: _Row) -> bool:
        if row.finish_reason is None:
            return False
        row.future.set_result(
            GenerationOutput(
                token_ids=row.token_ids,
                logprobs=row.logprobs,
                finish_reason=row.finish_reason,
                weight_version=self._version,
                prompt_token_ids=row.prompt,
            )
        )
        with self._schedule:
            self._in_flight -= 1
            self._schedule.notify_all()  # a refit may be waiting for the last row
        return True

    def _prefill(self, rows: Sequence[_Row]) -> list[_Arrival]:
        """Run the prompts of `rows` packed, sample each row's first token, return their caches.

        A row whose prompt starts with a cached prefix computes only the rest: the chunk's
        cached prefixes are laid side by side in front of its packed new tokens, and each new
        token attends to its own row's prefix and to its row's earlier new tokens. Every
        prefilled prompt goes to the prefix cache, and rows sharing a prefix with another row
        of this batch wait for it to be cached (`plan_prefill`).
        """
        arrivals: list[_Arrival] = []
        waiting = list(rows)
        while waiting:
            now, later = plan_prefill([row.prompt for row in waiting], self._prefix_cache)
            admissions = [_Admission(waiting[index], prefix) for index, prefix in now]
            for admission in admissions:
                admission.row.reused = admission.reused
            for chunk in _prefill_chunks(admissions, self._prefill_token_budget):
                for arrival in self._prefill_chunk(chunk):
                    self._prefix_cache.store(arrival.row.prompt, arrival.keys, arrival.values)
                    arrivals.append(arrival)
            waiting = [waiting[index] for index in later]
        return arrivals

    def _prefill_chunk(self, chunk: Sequence[_Admission]) -> list[_Arrival]:
        device = self._device
        reused = torch.tensor([a.reused for a in chunk], device=device)
        fresh = torch.tensor([len(a.fresh) for a in chunk], device=device)
        rows_index = torch.arange(len(chunk), device=device)
        ids = torch.tensor([t for a in chunk for t in a.fresh], device=device)
        segment = torch.repeat_interleave(rows_index, fresh)
        ends = fresh.cumsum(0)
        starts = ends - fresh
        positions = torch.arange(len(ids), device=device) - starts[segment] + reused[segment]
        causal = (segment[:, None] == segment[None, :]) & (positions[:, None] >= positions[None, :])
        prefix_owner = torch.repeat_interleave(rows_index, reused)
        allowed = torch.cat([segment[:, None] == prefix_owner[None, :], causal], dim=1)
        layers = self._layers_holding([a.prefix for a in chunk if a.prefix], len(ids))
        logits = self._forward(
            ids[None],
            additive_mask(allowed[None, None], self._dtype),
            positions[None],
            layers,
            ends - 1,
        )[0]
        self._sample_into([a.row for a in chunk], logits)
        cached = [layer.cached() for layer in layers]
        offset = int(reused.sum())
        arrivals = []
        for admission, start, end in zip(chunk, starts.tolist(), ends.tolist(), strict=True):
            fresh_keys = [keys[0, :, offset + start : offset + end] for keys, _ in cached]
            fresh_values = [values[0, :, offset + start : offset + end] for _, values in cached]
            prefix = admission.prefix
            if prefix is not None:
                fresh_keys = [
                    torch.cat(pair, dim=1) for pair in zip(prefix.keys, fresh_keys, strict=True)
                ]
                fresh_values = [
                    torch.cat(pair, dim=1) for pair in zip(prefix.values, fresh_values, strict=True)
                ]
            arrivals.append(_Arrival(admission.row, keys=fresh_keys, values=fresh_values))
        return arrivals

    def _layers_holding(self, prefixes: Sequence[CachedPrefix], room: int) -> list[_BufferedLayer]:
        """One cache layer per model layer, holding `prefixes` side by side, with room for
        `room` more tokens (empty layers, the model allocates, when there is no prefix)."""
        if not prefixes:
            return [_BufferedLayer(dtype=self._cache_dtype) for _ in range(self._num_layers)]
        length = sum(prefix.length for prefix in prefixes)
        layers = []
        for layer in range(self._num_layers):
            buffers = []
            for parts in ([p.keys[layer] for p in prefixes], [p.values[layer] for p in prefixes]):
                heads, dim = parts[0].shape[0], parts[0].shape[-1]
                buffer = parts[0].new_empty(1, heads, length + room, dim)
                start = 0
                for part in parts:
                    buffer[0, :, start : start + part.shape[1]] = part
                    start += part.shape[1]
                buffers.append(buffer)
            layers.append(_BufferedLayer(buffers[0], buffers[1], length))
        return layers

    def _keep_finished_caches(self, batch: _DecodeBatch) -> None:
        """Hand the keys and values of the rows that just finished to the prefix cache: what
        they cached is their prompt and every generated token but the last."""
        finished = [i for i, row in enumerate(batch.rows) if row.finish_reason is not None]
        if not finished:
            return
        width = batch.width
        cached = [layer.cached() for layer in batch.layers]
        for index in finished:
            row = batch.rows[index]
            begin = width - row.cached
            self._prefix_cache.store(
                row.prompt + row.token_ids[:-1],
                [keys[index, :, begin:] for keys, _ in cached],
                [values[index, :, begin:] for _, values in cached],
            )

    def _decode_step(self, batch: _DecodeBatch) -> None:
        """Feed every row its last sampled token and sample the next one."""
        # Grown before the step, not by the layers' `update` during it: the fused step's mask
        # spans the whole buffer, so it must be built over the capacity the step will read.
        batch.reserve(1)
        width = batch.width + 1
        cached = torch.tensor([row.cached for row in batch.rows], device=self._device)
        # The fused step attends over the whole buffer (dense, see `_BufferedLayer.buffers`).
        columns = torch.arange(width if self._decoder is None else batch.capacity)
        allowed = (columns >= (width - 1 - cached)[:, None]) & (columns < width)
        last = torch.tensor([row.token_ids[-1] for row in batch.rows], device=self._device)
        mask = additive_mask(allowed[:, None, None, :], self._dtype)
        if self._decoder is None:
            logits = self._forward(last[:, None], mask, cached[:, None], batch.layers, 1)[:, -1]
        else:
            logits = self._decoder.logits(self._decoder.hidden(last, cached, mask, batch.layers))
        self._sample_into(batch.rows, logits)

    def _forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        layers: Sequence[_BufferedLayer],
        logits_to_keep: int | torch.Tensor,
    ) -> torch.Tensor:
        """Logits of one forward pass whose attention reads and extends `layers`, one per model
        layer."""
        with body_autocast(self._device, self._compute_dtype):
            hidden = self._model.base_model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=True,
                # A list of its own: Cache types `layers` as a list of any cache layer kind.
                **{self._cache_argument: Cache(layers=list(layers))},
            ).last_hidden_state
        # What transformers' causal LMs do with `logits_to_keep`: an int keeps the last that
        # many positions (0 = all), a tensor the positions it lists.
        kept = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return self._output_layer(hidden[:, kept].to(self._dtype))

    def _sample_into(self, rows: Sequence[_Row], logits: torch.Tensor) -> None:
        """Sample one token for each row from `logits` `[len(rows), vocab]` and record it."""
        temperature = torch.tensor([row.params.temperature for row in rows], device=logits.device)
        top_p = torch.tensor([row.params.top_p for row in rows], device=logits.device)
        uniforms = torch.tensor(
            [
                float(torch.rand((), generator=row.generator))
                if row.params.temperature > 0
                else 0.0
                for row in rows
            ],
            device=logits.device,
        )
        tokens, logprobs = sample_tokens(logits, temperature, top_p, uniforms)
        for row, token, logprob in zip(rows, tokens.tolist(), logprobs.tolist(), strict=True):
            row.add(token, logprob)

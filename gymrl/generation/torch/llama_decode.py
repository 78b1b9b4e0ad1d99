"""The torch engine's own decode step for Llama-family models: one token per row over the KV cache.

A decode step at the engine's batch sizes reads every weight once for little arithmetic, so it
should cost about the time to stream the weights from memory. Through the Hugging Face model it
costs several times that (benchmarks/README.md, "The torch engine's decode step against the
weight-streaming bound"): matrix products that re-pack their weights at every call, attention
that copies the cache, and per layer the model's Python, cache object and autocast casts. This
module runs the same computation with the few ops it needs:

- the query, key and value projections as one matrix product, and the gate and up projections as
  another (the model's own weights become row views of the fused matrices);
- on the CPU, every matrix product of the step (the output layer's too) on weights laid out once
  for oneDNN (`mkldnn._reorder_linear_weight`, what torch.compile's frozen CPU graphs use): a
  plain `linear` re-packs its weight at every call, and at one token per row that packing is
  most of the product's time. The packed copies cost the weights' bytes once more and are
  re-packed at every refit (`refresh`);
- keys and values written straight into the engine's cache buffers, which hold them in the
  compute dtype, what attention reads them in;
- attention written out as two batched matrix products over the *whole* cache buffer (spare
  columns masked): the query heads that share a key/value head are that head's queries (no
  repeated keys), and a dense buffer is multiplied in place, where a view of its filled part
  would be copied at every layer; SDPA's CPU kernel, for one query per head, took several times
  as long. The scale is folded into the packed query weights, the rotary tables are computed
  once per step.

Every other op is the one the model runs, in the same dtype and order (the norms in float32, the
matrix products in the compute dtype, the rotary embedding in float32 as under autocast). In
float32 the log-probabilities match the model's own step to 1e-6; in bfloat16 attention sums in
another order than SDPA's kernel (scores rounded to bfloat16 before the softmax), a difference of
the size of bfloat16 rounding itself, checked against the parity gate's tolerance on SmolLM2
(tests/gymrl/generation/torch/test_llama_decode.py). Models this does not cover
(`unsupported_reason`) decode through the model itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import torch
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaModel


class CacheLayer(Protocol):
    """One layer's cache as the engine keeps it, `[batch, kv_heads, capacity, head_dim]`:
    `update` writes the next columns, `buffers` returns the whole dense buffers (the columns not
    yet written hold finite numbers, which the mask hides)."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]: ...


def unsupported_reason(model: PreTrainedModel) -> str | None:
    """Why `LlamaDecoder` cannot decode `model` exactly as the model does, or None if it can."""
    body = model.base_model
    if not isinstance(body, LlamaModel):
        return f"its body is {type(body).__name__}, not LlamaModel"
    config = body.config
    for name in ("attention_bias", "mlp_bias"):
        if getattr(config, name, False):
            return f"config.{name} is true (projections with biases)"
    if config.hidden_act != "silu":
        return f"config.hidden_act is {config.hidden_act!r}, not 'silu'"
    if getattr(config, "pretraining_tp", 1) != 1:
        return f"config.pretraining_tp is {config.pretraining_tp}, not 1"
    if config._attn_implementation != "sdpa":
        return f"its attention implementation is {config._attn_implementation!r}, not 'sdpa'"
    if len(body.layers) != config.num_hidden_layers:
        return "it runs fewer layers than it holds"
    output = model.get_output_embeddings()
    if not isinstance(output, torch.nn.Linear) or output.bias is not None:
        return "its output layer is not a Linear without bias"
    return None


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's weights, as the fused step reads them (`_Products.prepare`d)."""

    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    output: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor


def _fuse(linears: Sequence[torch.nn.Linear]) -> torch.Tensor:
    """Stack the weights of `linears` (same input size) into one matrix and make each Linear's
    weight a view of its rows, so loading weights into the Linears fills the matrix."""
    fused = torch.cat([linear.weight.detach() for linear in linears])
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight = torch.nn.Parameter(fused[start : start + rows], requires_grad=False)
        start += rows
    return fused


class _Products:
    """Matrix products `inputs @ weight.T` on weights prepared once: packed for oneDNN on a CPU
    that has it (for `batch_size` rows), as they are elsewhere."""

    def __init__(self, device: torch.device, batch_size: int) -> None:
        self._packed = (
            device.type == "cpu"
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")  # a private op of torch's
        )
        self._batch_size = batch_size

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        if not self._packed:
            return weight
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), self._batch_size)

    def __call__(self, inputs: torch.Tensor, prepared: torch.Tensor) -> torch.Tensor:
        if not self._packed:
            return torch.nn.functional.linear(inputs, prepared)
        return torch.ops.mkldnn._linear_pointwise(inputs, prepared, None, "none", [], "")


class LlamaDecoder:
    """One decode step of a Llama model (see the module docstring), matmuls in `compute_dtype`
    (None: the weights' own dtype, no autocast), laid out for up to `batch_size` rows. Rewires
    the model's projection weights as views of fused matrices; the model computes the same as
    before. Call `refresh` after loading new weights into the model."""

    def __init__(
        self, model: PreTrainedModel, compute_dtype: torch.dtype | None, batch_size: int
    ) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"LlamaDecoder cannot decode {type(model).__name__}: {reason}")
        body, output_layer = model.base_model, model.get_output_embeddings()
        assert isinstance(body, LlamaModel) and isinstance(output_layer, torch.nn.Linear)
        config = body.config
        self._body = body
        self._decoder_layers = [cast(LlamaDecoderLayer, layer) for layer in body.layers]
        self._compute_dtype = compute_dtype
        self._eps = float(config.rms_norm_eps)
        self._heads = int(config.num_attention_heads)
        self._kv_heads = int(config.num_key_value_heads or self._heads)
        self._head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self._heads)
        self._scaling = self._head_dim**-0.5
        self._intermediate = int(config.intermediate_size)
        self._output_layer = output_layer
        self._products = _Products(output_layer.weight.device, batch_size)
        with torch.no_grad():
            self._fused = [
                (
                    _fuse([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]),
                    _fuse([layer.mlp.gate_proj, layer.mlp.up_proj]),
                )
                for layer in self._decoder_layers
            ]
        self.refresh()

    def refresh(self) -> None:
        """Prepare the matrix products' operands from the model's weights as they are now."""
        prepare = self._products.prepare
        # The queries' rows carry attention's scale (exact when it is a power of two: 1/8 at 64).
        queries = self._heads * self._head_dim
        with torch.no_grad():
            self._layers = [
                _Layer(
                    input_norm=layer.input_layernorm.weight,
                    qkv=prepare(torch.cat([qkv[:queries] * self._scaling, qkv[queries:]])),
                    output=prepare(layer.self_attn.o_proj.weight),
                    post_norm=layer.post_attention_layernorm.weight,
                    gate_up=prepare(gate_up),
                    down=prepare(layer.mlp.down_proj.weight),
                )
                for layer, (qkv, gate_up) in zip(self._decoder_layers, self._fused, strict=True)
            ]
            self._output = prepare(self._output_layer.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output layer on `hidden` `[batch, hidden]`, in the output layer's dtype (as the
        engine computes logits, outside autocast)."""
        return self._products(hidden.to(self._output_layer.weight.dtype), self._output)

    def hidden(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        cache: Sequence[CacheLayer],
    ) -> torch.Tensor:
        """The final hidden states `[batch, hidden]` (after the last norm) for one new token per
        row: `token_ids` and `positions` `[batch]`, `mask` additive `[batch, 1, 1, capacity]`
        over the cache's columns (open on each row's cached tokens and the column its new token
        goes to), `cache` one layer per model layer (extended by the new keys and values)."""
        batch = token_ids.shape[0]
        hidden = self._body.embed_tokens(token_ids)
        cos, sin = self._body.rotary_emb(hidden, positions[:, None])  # [batch, 1, head_dim]
        cos, sin = cos[:, :, None], sin[:, :, None]  # broadcast over heads
        heads, kv_heads, dim = self._heads, self._kv_heads, self._head_dim
        rotated = (heads + kv_heads) * dim
        mask = self._operand(mask)
        for layer, layer_cache in zip(self._layers, cache, strict=True):
            qkv = self._linear(self._norm(hidden, layer.input_norm), layer.qkv)
            # Queries and keys rotated together: `[batch, 1, heads + kv_heads, head_dim]`.
            qk = _rotate(qkv[:, None, :rotated].view(batch, 1, heads + kv_heads, dim), cos, sin)
            layer_cache.update(
                qk[:, 0, heads:, None], qkv[:, rotated:].view(batch, kv_heads, 1, dim)
            )
            keys, values = layer_cache.buffers()
            # The query heads that share a key/value head, as that head's queries (scaled by the
            # packed weights).
            queries = qk[:, 0, :heads].to(
                self._compute_dtype or qk.dtype, memory_format=torch.contiguous_format
            )  # dense: the matrix product copies a strided operand
            queries = queries.view(batch, kv_heads, -1, dim)
            scores = torch.matmul(queries, self._operand(keys).transpose(-1, -2))
            # Softmax sums in float32 and rounds the weights to the compute dtype.
            weights = torch.softmax(scores + mask, dim=-1)
            attended = torch.matmul(weights, self._operand(values))
            hidden = hidden + self._linear(attended.reshape(batch, heads * dim), layer.output)
            gate, up = self._linear(self._norm(hidden, layer.post_norm), layer.gate_up).split(
                self._intermediate, dim=-1
            )
            hidden = hidden + self._linear(torch.nn.functional.silu(gate) * up, layer.down)
        return self._norm(hidden, self._body.norm.weight)

    def _operand(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` in the compute dtype, as autocast hands it to a matmul."""
        return tensor if self._compute_dtype is None else tensor.to(self._compute_dtype)

    def _linear(self, inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self._products(self._operand(inputs), weight)

    def _norm(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """LlamaRMSNorm: in float32, the result back in the stream's dtype, times the weight."""
        normed = torch.rms_norm(hidden.float(), (hidden.shape[-1],), None, self._eps)
        return weight * normed.to(hidden.dtype)


def _rotate(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding as transformers' Llama applies it (`q * cos + rotate_half(q) * sin`)."""
    half = states.shape[-1] // 2
    turned = torch.cat((-states[..., half:], states[..., :half]), dim=-1)
    return states * cos + turned * sin

"""`policy.compute_dtype`: what autocast each choice resolves to, that it is only autocast, and
that the generation engine's once-rounded weights give autocast the very same operands."""

import copy

import pytest
import torch

from gymrl.model.loading import build_tiny_llama
from gymrl.model.precision import (
    body_autocast,
    native_bfloat16,
    resolve_compute_dtype,
    round_body_matmul_weights,
)

CPU = torch.device("cpu")


def test_explicit_choices_are_taken_as_given():
    assert resolve_compute_dtype("float32", CPU) is None
    assert resolve_compute_dtype("bfloat16", CPU) is torch.bfloat16


def test_auto_takes_bfloat16_only_where_the_device_runs_it_natively():
    expected = torch.bfloat16 if native_bfloat16(CPU) else None
    assert resolve_compute_dtype("auto", CPU) is expected
    assert resolve_compute_dtype("auto", torch.device("meta")) is None


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_the_weights_keep_their_dtype_and_the_matmul_takes_the_compute_dtype(dtype):
    layer = torch.nn.Linear(8, 8)
    with body_autocast(CPU, dtype):
        out = layer(torch.ones(2, 8))
    assert layer.weight.dtype is torch.float32
    assert out.dtype is (dtype or torch.float32)


def test_rounding_the_body_weights_once_gives_autocast_the_same_operands(tokenizer):
    model = build_tiny_llama(
        tokenizer, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, seed=0
    )
    rounded = copy.deepcopy(model)
    round_body_matmul_weights(rounded, torch.bfloat16)
    ids = torch.tensor([tokenizer.encode("The calculator says 605.")])
    with torch.inference_mode(), body_autocast(CPU, torch.bfloat16):
        expected = model.base_model(input_ids=ids).last_hidden_state
        hidden = rounded.base_model(input_ids=ids).last_hidden_state
    assert torch.equal(hidden, expected)
    layer = rounded.model.layers[0]
    assert layer.self_attn.q_proj.weight.dtype is torch.bfloat16
    assert layer.mlp.down_proj.weight.dtype is torch.bfloat16
    # The residual stream and the logits stay in float32, as the trainer computes them.
    assert rounded.model.embed_tokens.weight.dtype is torch.float32
    assert layer.input_layernorm.weight.dtype is torch.float32
    assert rounded.lm_head.weight.dtype is torch.float32


def test_without_autocast_nothing_is_rounded(tokenizer):
    model = build_tiny_llama(
        tokenizer, hidden_size=64, num_layers=1, num_heads=4, intermediate_size=128, seed=0
    )
    round_body_matmul_weights(model, None)
    assert {p.dtype for p in model.parameters()} == {torch.float32}

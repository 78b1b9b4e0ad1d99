"""`policy.compute_dtype`: what autocast each choice resolves to, and that it is only autocast."""

import pytest
import torch

from gymrl.model.precision import body_autocast, native_bfloat16, resolve_compute_dtype

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

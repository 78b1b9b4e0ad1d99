"""Three places where SGLang 0.5.23 assumes CUDA on the mixture-of-experts path, and one on its
LoRA path, replaced in plain torch for the real server on a CPU (beside the `sgl_kernel`
stand-in and put on the server's PYTHONPATH with it; `sitecustomize.py` installs them in every
server process).

Each replacement is applied right after SGLang's module is first imported (a post-import hook), so
nothing in the venv is edited, and only on the path that fails without it:

* `--enable-return-routed-experts` (router replay): the routed-experts capture keeps its host copy
  in memory that `sglang/srt/mem_cache/pool_host/common.py` allocates pinned, through
  `cudaHostRegister` for device "cpu" (`ALLOC_MEMORY_FUNCS`), which fails at start-up without an
  NVIDIA driver. On a CPU server host memory is all there is: plain, unpinned.
* `--ep-size` > 1: the standard dispatcher turns the global expert ids of the other ranks' experts
  into -1 (the drop sentinel the GPU runners skip), and the CPU runner
  `sglang/srt/layers/moe/fused_moe_native.py` `moe_forward_native` counts experts with
  `scatter_`, which fails on -1 ("index -1 is out of bounds"). With a dropped slot the local
  experts run in a plain loop instead; the all-reduce after the MoE layer adds the other ranks'.
* The weight checker's compare (`POST /weights_checker`, `generation.refit.verify_weights`):
  `sglang/srt/utils/weight_checker_comparator.py` moves every chunk to CUDA before comparing.
  Only when the server's environment sets `GYMRL_CPU_WEIGHT_COMPARE=1` (the CPU experiments do,
  in `generation.launch.env`) are the chunks compared where they are, so a test can still see
  what stock SGLang does on a CPU (the compare cannot run, and the project's check says so before
  it changes any weight).
* `--enable-lora` with `--lora-backend torch_native` (a LoRA run's adapters): the LoRA layers
  (`sglang/srt/lora/layers.py`) and the torch_native backend (`srt/lora/backend/torch_backend.py`)
  keep their segment offsets in pinned host memory (`torch.tensor(..., pin_memory=True)`,
  `Tensor.pin_memory()`), which fails without an NVIDIA driver, at start-up and at the first
  batch. On a CPU server host memory is all there is: those two modules get a `torch` whose
  tensor factories ignore `pin_memory`, and `Tensor.pin_memory` returns the tensor itself.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

WEIGHT_COMPARE_ENV = "GYMRL_CPU_WEIGHT_COMPARE"


def _unpinned_host_memory(module: ModuleType) -> None:
    import torch

    def allocate(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
        del device, pin_memory, allocator, registration_granularity_bytes
        return torch.empty(dims, dtype=dtype, device="cpu")

    module.ALLOC_MEMORY_FUNCS["cpu"] = allocate


def _dropped_experts_skipped(module: ModuleType) -> None:
    import torch
    import torch.nn.functional as F

    every_expert = module.moe_forward_native

    def moe_forward_native(layer, x, topk_output, moe_runner_config):
        weights, ids = topk_output[0], topk_output[1]
        if not bool((ids < 0).any()):
            return every_expert(layer, x, topk_output, moe_runner_config)
        plain = (
            moe_runner_config.activation == "silu"
            and moe_runner_config.gemm1_alpha is None
            and getattr(layer, "w13_weight_bias", None) is None
        )
        if not plain:
            raise NotImplementedError(
                "the CPU expert-parallel stand-in runs SiLU-gated experts without biases only"
            )
        out = torch.zeros_like(x, dtype=torch.float32)
        for expert in range(layer.w13_weight.shape[0]):  # this rank's experts, local ids
            token, slot = (ids == expert).nonzero(as_tuple=True)
            if token.numel():
                gate, up = F.linear(x[token], layer.w13_weight[expert]).chunk(2, dim=-1)
                y = F.linear(F.silu(gate) * up, layer.w2_weight[expert])
                out.index_add_(0, token, y.float() * weights[token, slot, None].float())
        return out.to(x.dtype)

    module.moe_forward_native = moe_forward_native


def _compare_where_the_weights_are(module: ModuleType) -> None:
    def iter_chunks(self):
        flat = self.tensor.reshape(-1)
        for start in range(0, flat.numel(), module.CHUNK_NUMEL):
            yield flat[start : start + module.CHUNK_NUMEL], None

    module.RawComparable.iter_chunks = iter_chunks


# The tensor factories SGLang's LoRA path calls with `pin_memory=True`.
_FACTORIES = frozenset({"tensor", "zeros", "ones", "empty", "full", "arange"})


class _TorchWithoutPinning(ModuleType):
    """`torch` as a LoRA module of SGLang sees it: the same, but a tensor asked for with
    `pin_memory=True` is made in plain host memory."""

    def __init__(self, torch: ModuleType) -> None:
        super().__init__("torch")
        self._torch = torch

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._torch, name)
        if name not in _FACTORIES:
            return found

        def unpinned(*args: Any, pin_memory: bool = False, **kwargs: Any) -> Any:
            del pin_memory
            return found(*args, **kwargs)

        return unpinned


def _unpinned_lora_buffers(module: ModuleType) -> None:
    import torch

    module.__dict__["torch"] = _TorchWithoutPinning(torch)
    # The layers and the torch_native backend also pin copies with `Tensor.pin_memory()`;
    # without a GPU a pinned copy is the tensor itself (nothing copies it to a device).
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self  # type: ignore[method-assign]


def _replacements() -> dict[str, Callable[[ModuleType], None]]:
    found = {
        "sglang.srt.mem_cache.pool_host.common": _unpinned_host_memory,
        "sglang.srt.layers.moe.fused_moe_native": _dropped_experts_skipped,
        "sglang.srt.lora.layers": _unpinned_lora_buffers,
        "sglang.srt.lora.backend.torch_backend": _unpinned_lora_buffers,
    }
    if os.environ.get(WEIGHT_COMPARE_ENV) == "1":
        found["sglang.srt.utils.weight_checker_comparator"] = _compare_where_the_weights_are
    return found


class _AfterImport(importlib.abc.MetaPathFinder):
    """Loads each module of `replacements` as usual, then applies its replacement."""

    def __init__(self, replacements: dict[str, Callable[[ModuleType], None]]) -> None:
        self._replacements = replacements

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in self._replacements:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module
        replace = self._replacements[name]

        def exec_module(module: ModuleType) -> None:
            load(module)
            replace(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """In this process (idempotent)."""
    if not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(_replacements()))

"""Megatron-core 0.19 and Megatron-Bridge 0.6 on a machine without CUDA: the Megatron tests and
`+experiment=flagship_cpu` (whose `cluster.roles.trainer.setup_hook` names `prepare_process`).

megatron-core assumes CUDA in places that no configuration reaches (device strings, the CUDA RNG,
streams, NCCL). `install()` puts CPU stand-ins there, in this process, with nothing edited on
disk, so the trainer's own code (`gymrl/trainer/megatron/`) runs unchanged on the CPU over gloo.
Every part below names the megatron source it works around. Where CUDA exists the tests run
without any of it (`launch/gpu_check/run.sh`), and a GPU run needs none of it: this module never
ships with the trainer (`cpu_standins/README.md`).

`install()` is idempotent and meant for the whole process (a pytest session, a spawned rank, a
Ray worker's `worker_process_setup_hook`); `uninstall()` undoes it. `prepare_process()` is what
those call: the shim without CUDA, only the imports with it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed
from torch.overrides import TorchFunctionMode

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


def _is_cuda(device: Any) -> bool:
    """`"cuda"`, `"cuda:N"`, a CUDA `torch.device`, or a bare index (torch reads it as cuda:N)."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class CudaOnCpu(TorchFunctionMode):
    """Every torch call that asks for a CUDA tensor gets a CPU one.

    - `device="cuda"` / `device=torch.cuda.current_device()` keywords, `Tensor.to`'s included:
      the causal mask (`megatron/core/transformer/utils.py` get_default_causal_mask, taken when
      the mask is None, as the trainer passes it), rotary `inv_freq` (`models/common/embeddings/
      rotary_pos_embedding.py`), DDP's grad buffers (`distributed/param_and_grad_buffer.py`), the
      optimizer's and grad clipping's scalars (`optimizer/optimizer.py`, `optimizer/
      clip_grads.py`), the schedule's token count (`pipeline_parallel/schedules.py`), the
      saver's validation tensor (`dist_checkpointing/strategies/state_dict_saver.py`).
    - `Tensor.to(torch.cuda.current_device())` stays on the CPU: Bridge's TP scatter of the
      Hugging Face weights (`megatron/bridge/models/conversion/param_mapping.py`, TP > 1).
    - `Tensor.cuda()` returns the CPU tensor: Bridge's
      `model_module.cuda(torch.cuda.current_device())` (`megatron/bridge/models/
      model_provider.py`), the optimizer's state moves (`optimizer/optimizer.py`).
    - `Tensor.type()` answers with the CUDA type name: the fp32 parameter checks of
      `optimizer/distrib_optimizer.py` and `optimizer/optimizer.py` accept only
      `torch.cuda.FloatTensor`.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = CPU
        if func is torch.Tensor.to:
            args = tuple(CPU if _is_cuda(arg) else arg for arg in args)
        return func(*args, **kwargs)


class _Stream:
    """`torch.cuda.Stream` on the CPU, where work is already in order: DDP's communication
    stream (`distributed/distributed_data_parallel.py`) that the grad buffers
    (`distributed/param_and_grad_buffer.py`) enter and wait on, and the MoE all-to-all
    dispatcher's device-to-host stream (`transformer/moe/token_dispatcher.py`
    `_maybe_dtoh_and_synchronize`), which records an event to synchronize on later."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def wait_stream(self, stream: Any) -> None:
        del stream

    def wait_event(self, event: Any) -> None:
        del event

    def record_event(self, event: Any = None) -> _Event:
        del event
        return _Event()


class _Event:
    """`torch.cuda.Event` on the CPU: whatever it marks has already happened."""

    def synchronize(self) -> None:
        pass


def _cpu_rng_state(device: Any = "cuda") -> torch.Tensor:
    del device
    return torch.get_rng_state()


def _seed_cpu(seed: int) -> None:
    torch.default_generator.manual_seed(seed)


def _run_now(callable_: Callable[[], None], **kwargs: Any) -> None:
    """`torch.cuda._lazy_call` without CUDA queues the call forever; run it now instead."""
    del kwargs
    callable_()


def _gloo(backend: Any) -> Any:
    return "gloo" if isinstance(backend, str) and "nccl" in backend else backend


def _backend_to_gloo(function: Callable[..., Any]) -> Callable[..., Any]:
    """`init_process_group("nccl")` (the trainer) and `new_group(backend="nccl", pg_options=NCCL
    options)` (`megatron/core/parallel_state.py`) over gloo; NCCL's options go with NCCL."""

    def over_gloo(*args: Any, **kwargs: Any) -> Any:
        if args and function.__name__ == "init_process_group":
            args = (_gloo(args[0]), *args[1:])
        if "backend" in kwargs:
            kwargs["backend"] = _gloo(kwargs["backend"])
            if kwargs["backend"] == "gloo":
                kwargs.pop("pg_options", None)
        return function(*args, **kwargs)

    over_gloo.__wrapped__ = function  # type: ignore[attr-defined]
    return over_gloo


_ABSENT = object()


class _Patches:
    """Attributes replaced on modules, and the mode pushed, so that `uninstall` restores them."""

    def __init__(self) -> None:
        self.saved: list[tuple[Any, str, Any]] = []
        self.mode: CudaOnCpu | None = None

    def set(self, owner: Any, name: str, value: Any) -> None:
        self.saved.append((owner, name, getattr(owner, name, _ABSENT)))
        setattr(owner, name, value)

    def restore(self) -> None:
        for owner, name, value in reversed(self.saved):
            if value is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        self.saved.clear()


_PATCHES = _Patches()


def _patch_torch_cuda(patches: _Patches) -> None:
    cuda = torch.cuda
    # `torch.cuda.current_device()` is read for device indices all over megatron-core (67 calls);
    # `set_device` by the trainer itself (`gymrl/trainer/megatron/worker.py`).
    patches.set(cuda, "current_device", lambda: 0)
    patches.set(cuda, "set_device", lambda device: None)
    patches.set(cuda, "synchronize", lambda device=None: None)
    patches.set(cuda, "Stream", _Stream)
    patches.set(cuda, "current_stream", lambda device=None: _Stream())
    patches.set(cuda, "stream", lambda stream=None: contextlib.nullcontext())
    # The RNG tracker (`tensor_parallel/random.py`: model_parallel_cuda_manual_seed and the
    # tracker's fork, which `transformer/dot_product_attention.py` and the weight init enter):
    # the CPU generator is the device generator of CPU tensors.
    patches.set(cuda, "manual_seed", _seed_cpu)
    patches.set(cuda, "get_rng_state", _cpu_rng_state)
    patches.set(cuda.random, "get_rng_state", _cpu_rng_state)
    patches.set(cuda, "default_generators", (torch.default_generator,))
    patches.set(cuda, "_lazy_call", _run_now)
    dist = torch.distributed
    patches.set(dist, "init_process_group", _backend_to_gloo(dist.init_process_group))
    patches.set(dist, "new_group", _backend_to_gloo(dist.new_group))
    patches.set(dist, "all_to_all_single", _splits_as_lists(dist.all_to_all_single))


def _splits_as_lists(function: Callable[..., Any]) -> Callable[..., Any]:
    """The MoE all-to-all dispatcher's split sizes as lists: it turns them into lists only when
    they are CUDA tensors (`transformer/moe/moe_utils.py` `maybe_move_tensor_to_cpu`), and the
    process group's `all_to_all_single` takes no CPU tensor for them ("incompatible function
    arguments"), which expert parallelism 2 over gloo reaches
    (`tensor_parallel/mappings.py` `_AllToAll`)."""

    def with_lists(*args: Any, **kwargs: Any) -> Any:
        for key in ("output_split_sizes", "input_split_sizes"):
            if isinstance(kwargs.get(key), torch.Tensor):
                kwargs[key] = kwargs[key].tolist()
        return function(*args, **kwargs)

    with_lists.__wrapped__ = function  # type: ignore[attr-defined]
    return with_lists


def _python_311_typing(patches: _Patches) -> None:
    """`typing.override` (Python 3.12) for `megatron/training/models/gpt.py` and `hybrid.py`,
    which Bridge imports through `megatron/bridge/utils/common_utils.py`: the wheels declare
    Python >= 3.12 and this CPU role is 3.11. Harmless on 3.12."""
    if not hasattr(typing, "override"):  # also where install() saved it first: one patch
        import typing_extensions

        patches.set(typing, "override", typing_extensions.override)


def _import_bridge_without_te() -> None:
    """Bridge's LoRA layers (`megatron/bridge/peft/lora_layers.py`) import Transformer Engine
    unconditionally; `launch/gpu_check/bridge_without_te.py` imports Bridge without it."""
    path = REPO / "launch" / "gpu_check" / "bridge_without_te.py"
    spec = importlib.util.spec_from_file_location("bridge_without_te", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.import_bridge_without_te()


def _lazy_call_of_the_rng_tracker(patches: _Patches) -> None:
    """`tensor_parallel/random.py` imported `_lazy_call` by name before any patch could reach
    it; its `_set_cuda_rng_state` must run now, not be queued for a CUDA that never starts."""
    from megatron.core.tensor_parallel import random

    patches.set(random, "_lazy_call", _run_now)


def import_megatron() -> None:
    """Import Megatron-Bridge where this machine lacks what its wheels assume (Python 3.12,
    Transformer Engine); a GPU machine without Transformer Engine needs this part too."""
    _python_311_typing(_PATCHES)
    if importlib.util.find_spec("transformer_engine") is None:
        _import_bridge_without_te()


def install() -> None:
    """Megatron on the CPU in this process (idempotent)."""
    if _PATCHES.mode is not None:
        return
    if torch.cuda.is_available():
        raise RuntimeError("CUDA is available: run the Megatron tests on it, without this shim")
    _patch_torch_cuda(_PATCHES)
    mode = CudaOnCpu()
    mode.__enter__()
    _PATCHES.mode = mode
    import_megatron()
    _lazy_call_of_the_rng_tracker(_PATCHES)


def prepare_process() -> None:
    """What a process needs before it builds a Megatron trainer: on CUDA only the imports, else
    the whole shim. The pytest session, spawned ranks and Ray actors (as their
    `worker_process_setup_hook`) call it."""
    if torch.cuda.is_available():
        import_megatron()
    else:
        install()


def uninstall() -> None:
    """Undo :func:`install` (the imported megatron modules stay imported)."""
    if _PATCHES.mode is None:
        return
    _PATCHES.mode.__exit__(None, None, None)
    _PATCHES.mode = None
    _PATCHES.restore()

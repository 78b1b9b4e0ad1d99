"""pytest plugin: import Megatron-Bridge on a GPU machine that has no Transformer Engine.

Megatron-Bridge (0.3 to 0.6) imports `transformer_engine.pytorch` unconditionally in its LoRA
layers, which GRPO training never uses; Transformer Engine's wheels are far larger than what a
bare test machine can be given. Megatron-core probes for TE with try/except at import time, so:

1. every megatron.core module is imported first, with no TE anywhere (each records HAVE_TE=False);
2. only then, while Megatron-Bridge's package imports, `transformer_engine` is a placeholder whose
   attributes are placeholder classes that refuse to be instantiated;
3. the placeholder is removed straight after, so `importlib.util.find_spec("transformer_engine")`
   is None again and the trainer is configured with `trainer.transformer_impl=local`;
4. Bridge's LoRA (`megatron/bridge/peft/utils.py`, `module_matcher.py`) is told there is no TE:
   its probe imports megatron-core's TE classes by name and finds them (without TE megatron-core
   defines them over a MagicMock, or as None for the grouped ones), so it would believe TE is
   installed and call `isinstance(module, None)` on the first layer LoRA adapts
   (`get_adapter_attributes_from_linear`).

Load it with `-p bridge_without_te` (this folder on PYTHONPATH); `launch/gpu_check/run.sh` does.
Never use it where Transformer Engine is installed: there Bridge imports as it is.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import sys
import types

_TE_MODULES = ("transformer_engine", "transformer_engine.pytorch")


class _PlaceholderType(type):
    """A class whose every attribute is another placeholder class; making one refuses."""

    def __getattr__(cls, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _PlaceholderType(attr, (), {})

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"{cls.__name__}: Transformer Engine is not installed here")


def _placeholder_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)

    def attribute(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _PlaceholderType(attr, (), {})

    module.__getattr__ = attribute  # type: ignore[method-assign]
    return module


def _import_every_core_module() -> list[str]:
    core = importlib.import_module("megatron.core")
    failed = []
    for info in pkgutil.walk_packages(core.__path__, "megatron.core."):
        try:
            importlib.import_module(info.name)
        except Exception as error:  # optional extras (apex, flash-attn, ...) stay unimported
            failed.append(f"{info.name}: {type(error).__name__}")
    return failed


def import_bridge_without_te() -> list[str]:
    """Import megatron.bridge as above; returns the core modules that did not import."""
    if importlib.util.find_spec("transformer_engine") is not None:
        raise RuntimeError("Transformer Engine is installed: import Megatron-Bridge normally")
    failed = _import_every_core_module()
    for name in _TE_MODULES:
        sys.modules[name] = _placeholder_module(name)
    parent, child = (sys.modules[name] for name in _TE_MODULES)
    parent.pytorch = child  # type: ignore[attr-defined]
    try:
        importlib.import_module("megatron.bridge")
        lora_modules = [
            importlib.import_module(name)
            for name in ("megatron.bridge.peft.utils", "megatron.bridge.peft.module_matcher")
        ]
    finally:
        for name in _TE_MODULES:
            sys.modules.pop(name, None)
    for module in lora_modules:
        module.HAVE_TE = False  # pyright: ignore[reportAttributeAccessIssue]
    return failed


def pytest_configure(config) -> None:
    failed = import_bridge_without_te()
    print(f"bridge_without_te: Megatron-Bridge imported; {len(failed)} core modules skipped")
    for line in failed:
        print(f"  skipped {line}")

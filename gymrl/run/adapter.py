"""A LoRA adapter as PEFT writes it, the one form it takes outside the trainer.

The trainer attaches the adapter with PEFT (:func:`attach_lora`) and hands it on as
:class:`AdapterWeights`: PEFT's `adapter_config.json` fields and its state-dict keys
(`base_model.model.<module>.lora_A.weight`, `...lora_B.weight`). That is what a checkpoint holds
(`adapter_config.json` and `adapter_model.safetensors`, which every PEFT-reading tool loads), what
a refit moves to the torch engine, and what evaluation and the merge command read back. The
engine merges with :meth:`AdapterWeights.merged`; the merge command lets PEFT merge
(`merge_and_unload`), and the tests hold the engine to PEFT's merged model.

PEFT itself (seconds to import) is imported by the functions that need it: the processes that
only read or apply an adapter (the engine, evaluation, the driver) never load it.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load, load_file, save, save_file

from gymrl.config.schema.trainer import LoraConfig

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's prefix of every key of a causal LM's adapter, and its suffixes of the two factors.
_PREFIX = "base_model.model."
_FACTORS = {".lora_A.weight": "A", ".lora_B.weight": "B"}


def attach_lora(model: PreTrainedModel, lora: LoraConfig) -> PeftModel:
    """Wrap `model` (in place: its targeted Linear modules become PEFT LoRA layers) with a fresh
    adapter of `lora`'s shape; every base weight is frozen. A is drawn from torch's RNG, B is
    zero, so the adapted model starts as the base model."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    config = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():
        # PEFT 0.21 reads transformers' deprecated `is_gradient_checkpointing`; nothing a user
        # can act on, printed by every LoRA trainer otherwise.
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
        return get_peft_model(model, config)  # pyright: ignore[reportReturnType]


@dataclass(frozen=True)
class AdapterWeights:
    """A LoRA adapter: `config`, the fields of PEFT's `adapter_config.json`; `tensors`, its
    factors under PEFT's keys."""

    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (to cross Ray) with its tensors as safetensors bytes, not torch's storage
        pickling: importing megatron-core replaces `torch.storage._load_from_bytes` with its own
        (`megatron.core.safe_globals`), so a tensor pickled in a Megatron rank names a module
        the driver and the engines, which never import megatron, cannot unpickle."""
        tensors = {name: tensor.contiguous() for name, tensor in self.tensors.items()}
        return (_unpickle, (self.config, save(tensors)))

    @classmethod
    def of(cls, model: PeftModel) -> AdapterWeights:
        """The adapter of `model` as PEFT saves it, copied to the CPU."""
        from peft import get_peft_model_state_dict

        tensors = get_peft_model_state_dict(model)
        return cls(
            config=model.peft_config["default"].to_dict(),
            tensors={name: t.detach().to("cpu", copy=True) for name, t in tensors.items()},
        )

    @classmethod
    def read(cls, folder: str | Path) -> AdapterWeights:
        """The adapter PEFT saved in `folder`."""
        folder = Path(folder)
        config = json.loads((folder / ADAPTER_CONFIG_FILE).read_text())
        return cls(config=config, tensors=load_file(str(folder / ADAPTER_WEIGHTS_FILE)))

    def write(self, folder: str | Path) -> None:
        """Save as PEFT does (`adapter_config.json`, `adapter_model.safetensors` in `folder`), for
        a trainer whose adapter is not a PEFT model (Megatron's, through megatron-bridge). A set
        in the config (PEFT's own `target_modules`) is written as its sorted list, as PEFT
        writes it."""
        folder = Path(folder)
        (folder / ADAPTER_CONFIG_FILE).write_text(json.dumps(self.config, indent=2, default=sorted))
        tensors = {name: tensor.contiguous() for name, tensor in self.tensors.items()}
        save_file(tensors, str(folder / ADAPTER_WEIGHTS_FILE))

    @property
    def scaling(self) -> float:
        """What B @ A is multiplied by: lora_alpha / r, or over sqrt(r) with rsLoRA."""
        rank, alpha = self.config["r"], self.config["lora_alpha"]
        return alpha / (math.sqrt(rank) if self.config.get("use_rslora") else rank)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def module_pairs(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Module name (as the base model names it) -> (A, B). A key that is not a LoRA factor,
        or a factor without its pair, raises naming it: applying half an adapter would serve a
        policy nobody trained."""
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in self.tensors.items():
            suffix = next((s for s in _FACTORS if key.endswith(s)), None)
            if suffix is None or not key.startswith(_PREFIX):
                raise ValueError(
                    f"adapter key {key!r} is not a LoRA factor "
                    f"({_PREFIX}<module>.lora_A.weight / .lora_B.weight); only plain LoRA "
                    "adapters (no bias, no modules_to_save) are applied"
                )
            module = key[len(_PREFIX) : -len(suffix)]
            pairs.setdefault(module, {})[_FACTORS[suffix]] = tensor
        incomplete = sorted(module for module, factors in pairs.items() if len(factors) != 2)
        if incomplete:
            raise ValueError(f"adapter modules {incomplete} lack lora_A or lora_B")
        return {module: (factors["A"], factors["B"]) for module, factors in pairs.items()}

    def merged(self, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """`weight` `[out, in]` with its module's factors merged in, weight + scaling x B @ A,
        in float32 (PEFT merges so, `LoraLayer.get_delta_weight`). One fused product-and-add:
        on SmolLM2's 210 Linear weights on 2 loaded cores it took 5.0 s where the product, its
        scaling and the sum as three passes over the weights took 7.1-12.1 s."""
        return torch.addmm(weight.float(), b.float(), a.float(), alpha=self.scaling)


def _unpickle(config: dict[str, Any], tensors: bytes) -> AdapterWeights:
    """The other half of :meth:`AdapterWeights.__reduce__`."""
    return AdapterWeights(config=config, tensors=load(tensors))

"""LoRA adapters served by SGLang servers: the launch flags of a LoRA run's servers, the versioned
adapter names, and the load request of one version (SGLang 0.5.23, read in its wheel:
`srt/arg_groups/fields/lora.py`, `srt/arg_groups/lora_hook.py`, `srt/lora/`,
`srt/managers/tokenizer_control_mixin.py`).

A LoRA run's refit moves the adapter alone (`SGLangEngine.update_adapter`): every server loads
version v from tensors under the name `policy_v{v}`, and every generation request sent after
that names it (`lora_path`). The base weights never change, so the servers' own weight version
stays 0 all run. Older versions stay loaded for the staleness window, `versions_kept` =
`grpo.max_trajectory_age_steps + 1` (1 without async), so a request still running under an
older adapter finishes under it, and are unloaded past it, so the loaded count stays bounded
(SGLang 0.5.23 keeps every adapter it loaded until told otherwise; AReaL #1385: a run that loaded
one per step and never unloaded hung its server). `--max-loaded-loras` is one above the window,
room for the new version before the oldest goes, so SGLang's own LRU eviction never picks one.

SGLang fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, and stacks an adapter's
factors to match (`srt/lora/lora.py`, `normalize_qkv_proj` needs q_proj and v_proj,
`normalize_gate_up_proj` needs gate_proj): an adapter on part of a fused group is one SGLang
cannot serve, refused at composition time (`gymrl.preflight.rules.generation`). Strict loading
(`--lora-strict-loading`) is on, but SGLang checks it only when it moves an adapter into its
batch pool, at the first request naming it; so a refit checks the keys against the servers'
target modules itself (:func:`check_adapter`) before sending anything.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import pickle
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gymrl.config.schema.generation import SGLangLaunchConfig
from gymrl.config.schema.grpo import GRPOConfig
from gymrl.config.schema.trainer import LoraConfig

if TYPE_CHECKING:  # the preflight rules and the plan read this module, and must not load torch
    import torch

    from gymrl.run.adapter import AdapterWeights

# The module groups SGLang 0.5.23 fuses into one Linear, and the members an adapter on a group
# must include (srt/lora/lora.py: normalize_qkv_proj reads q_proj's and v_proj's factors,
# zero-filling a missing k_proj; normalize_gate_up_proj reads gate_proj's, zero-filling a
# missing up_proj).
FUSED_GROUPS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
FUSED_NEEDS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "v_proj"),
    "gate_up_proj": ("gate_proj",),
}
# A decoder layer's module, as SGLang finds its layer (`get_layer_id`: `layers\.(\d+)\.`).
_LAYER_MODULE = re.compile(r"(^|\.)layers\.\d+\.")


def adapter_name(version: int) -> str:
    """The name weight `version`'s adapter is loaded under on every server."""
    return f"policy_v{version}"


def versions_kept(grpo: GRPOConfig) -> int:
    """Adapter versions a server holds at once after a refit: the current one and every older
    one a trained episode may still come from (`max_trajectory_age_steps`, async only)."""
    return (grpo.max_trajectory_age_steps if grpo.async_enabled else 0) + 1


@dataclass(frozen=True)
class AdapterServing:
    """How a LoRA run's SGLang servers serve its adapters: the largest rank and the modules
    they hold adapters for, how many versions stay loaded, and SGLang's LoRA kernels."""

    rank: int
    target_modules: tuple[str, ...]
    versions_kept: int
    backend: str

    @classmethod
    def of(
        cls, lora: LoraConfig, grpo: GRPOConfig, launch: SGLangLaunchConfig
    ) -> AdapterServing | None:
        """A LoRA run's serving; None for a run that trains every weight."""
        if not lora.enabled:
            return None
        return cls(
            rank=lora.rank,
            target_modules=tuple(lora.target_modules),
            versions_kept=versions_kept(grpo),
            backend=launch.lora_backend,
        )

    @property
    def max_loaded(self) -> int:
        """`--max-loaded-loras`: the window plus the version being loaded."""
        return self.versions_kept + 1

    def server_flags(self) -> list[str]:
        """The `sglang.launch_server` flags. `--max-loras-per-batch` (adapters one batch mixes,
        the base counted) is the same bound: SGLang requires it at most `--max-loaded-loras`,
        and a batch never mixes more versions than are loaded."""
        return [
            "--enable-lora",
            "--max-lora-rank",
            str(self.rank),
            "--lora-target-modules",
            *self.target_modules,
            "--max-loaded-loras",
            str(self.max_loaded),
            "--max-loras-per-batch",
            str(self.max_loaded),
            "--lora-backend",
            self.backend,
            "--lora-strict-loading",
        ]


def check_adapter(adapter: AdapterWeights, serving: AdapterServing, version: int) -> None:
    """Raise, naming them, on what the servers would not serve as trained: a rank above
    `--max-lora-rank`, a key that is no LoRA factor (`AdapterWeights.module_pairs`), or a module
    outside the decoder layers or the servers' target modules (SGLang would skip it, or fail the
    first request naming the version under strict loading)."""
    where = f"adapter version {version}"
    rank = adapter.config.get("r")
    if not isinstance(rank, int) or rank > serving.rank:
        raise ValueError(
            f"{where} has rank {rank!r}; the SGLang servers hold adapters of rank at most "
            f"{serving.rank} (--max-lora-rank, from trainer.lora.rank)"
        )
    if adapter.config.get("use_rslora") or adapter.config.get("use_dora"):
        raise ValueError(
            f"{where} uses rsLoRA or DoRA, which SGLang 0.5.23 does not apply (it scales by "
            "lora_alpha / r and refuses DoRA); train a plain LoRA adapter"
        )
    try:
        modules = adapter.module_pairs()
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from error
    targets = set(serving.target_modules)
    unmatched = sorted(
        module
        for module in modules
        if not _LAYER_MODULE.search(module) or module.rsplit(".", 1)[-1] not in targets
    )
    if unmatched:
        raise ValueError(
            f"{where}: modules {unmatched[:5]} ({len(unmatched)} of {len(modules)}) match no "
            f"decoder-layer module of the SGLang servers' --lora-target-modules "
            f"{list(serving.target_modules)} (trainer.lora.target_modules); SGLang would not "
            "apply them"
        )


def serialized_tensors(tensors: dict[str, torch.Tensor]) -> str:
    """`tensors` as `/load_lora_adapter_from_tensors` takes them: a pickled `{key: tensor}`,
    base64. Pickled by value (the standard pickler writes each storage's bytes, which SGLang's
    restricted unpickler reads back through `torch.load(weights_only=True)`), not through
    torch's shared-memory reductions, so it reaches a server on another host."""
    buffer = io.BytesIO()
    pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(tensors)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def checksum(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes, as SGLang computes it on each rank (`tp_worker.py`,
    `expected_checksums`): what a server loaded is compared with what was sent."""
    import torch

    return hashlib.sha256(tensor.flatten().view(torch.uint8).numpy().tobytes()).hexdigest()


def load_request(
    adapter: AdapterWeights, version: int, tensor_parallel_size: int
) -> dict[str, Any]:
    """The `/load_lora_adapter_from_tensors` body of weight `version`: its name, PEFT's config
    (as JSON: PEFT's own dict holds sets), one copy of the tensors per TP rank (each rank reads
    its own, `deserialize_own_rank`) and each tensor's checksum, which every rank checks."""
    tensors = {key: tensor.detach().cpu().contiguous() for key, tensor in adapter.tensors.items()}
    payload = serialized_tensors(tensors)
    return {
        "lora_name": adapter_name(version),
        "config_dict": json.loads(json.dumps(adapter.config, default=sorted)),
        "serialized_named_tensors": [payload] * tensor_parallel_size,
        "expected_checksums": {key: checksum(tensor) for key, tensor in tensors.items()},
    }

"""Compose the Hydra tree outside `@hydra.main` (tests, notebooks, launch scripts).

The recipe itself is a `@hydra.main` program; this module gives the same composition through
Hydra's compose API, so a test validates exactly what `python recipes/grpo.py ...` would run.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

CONFIG_DIR = Path(__file__).resolve().parents[2] / "conf"
CONFIG_NAME = "grpo"


def compose_raw(overrides: Sequence[str] = (), config_dir: Path = CONFIG_DIR) -> dict[str, Any]:
    """The resolved plain-dict tree for `overrides` (e.g. `["+experiment=smoke"]`)."""
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        cfg = compose(config_name=CONFIG_NAME, overrides=list(overrides))
    return to_plain_dict(cfg)


def to_plain_dict(cfg: DictConfig) -> dict[str, Any]:
    container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    assert isinstance(container, dict)
    container.pop("hydra", None)
    return container


def experiment_names() -> list[str]:
    return sorted(path.stem for path in (CONFIG_DIR / "experiment").glob("*.yaml"))

"""Compose the Hydra tree: the schema's defaults first, then conf/ on top.

Hydra only accepts a plain override (`trainer.optimizer.lr=3e-6`, no `+`) for a key the composed
tree already holds, and `--cfg job` shows only what was composed. So the defaults of
`gymrl/config/schema/` enter the composition as ConfigStore nodes built from the pydantic
models, and the YAML files keep only what a scenario chooses:

* `schema`: every default outside the backend unions; the first entry of conf/grpo.yaml;
* `schema/generation/<backend>`, `schema/trainer/<backend>`: one node per backend class, pulled
  in by the group file of that backend (conf/generation/sglang.yaml, ...).

:func:`register_schema_defaults` must run before composition, in `recipes/grpo.py` and here in
:func:`compose_raw` (tests, notebooks, launch scripts), so a test composes exactly what
`python recipes/grpo.py ...` would run.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from gymrl.config.schema.generation import GenerationConfig
from gymrl.config.schema.recipe import RecipeConfig
from gymrl.config.schema.trainer import TrainerConfig
from nemo_gym_ext.config import NemoGymPostprocessConfig

CONFIG_DIR = Path(__file__).resolve().parents[2] / "conf"
CONFIG_NAME = "grpo"
SCHEMA_NODE = "schema"
BACKEND_UNIONS = {"generation": GenerationConfig, "trainer": TrainerConfig}


def schema_defaults(model: type[BaseModel]) -> dict[str, Any]:
    """Every default of `model` as a plain tree. Required fields are left out (the YAML must set
    them, and validation names the missing ones); a required sub-model still contributes the
    defaults of its own fields. A union of models (the backends) has no single set of defaults:
    each member is its own node (:data:`BACKEND_UNIONS`)."""
    tree: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        if not field.is_required():
            tree[name] = to_jsonable_python(field.get_default(call_default_factory=True))
        elif isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            tree[name] = schema_defaults(field.annotation)
    return tree


def backend_classes(union: Any) -> dict[str, type[BaseModel]]:
    """The members of a discriminated union (`GenerationConfig`, ...) by their `backend` tag."""
    members = typing.get_args(typing.get_args(union)[0])
    return {member.model_fields["backend"].default: member for member in members}


def recipe_defaults() -> dict[str, Any]:
    """The `schema` node: every default outside the backend unions, including the recipe-only
    keys of `env.nemo_gym` (Gym's own keys there are not the recipe's to default)."""
    tree = schema_defaults(RecipeConfig)
    tree["env"]["nemo_gym"] = NemoGymPostprocessConfig().model_dump(mode="json")
    return tree


def register_schema_defaults() -> None:
    """Store the schema's defaults in Hydra's ConfigStore (idempotent: a node is replaced)."""
    store = ConfigStore.instance()
    store.store(name=SCHEMA_NODE, node=recipe_defaults())
    for group, union in BACKEND_UNIONS.items():
        for backend, model in backend_classes(union).items():
            store.store(group=f"{SCHEMA_NODE}/{group}", name=backend, node=schema_defaults(model))


def compose_raw(overrides: Sequence[str] = (), config_dir: Path = CONFIG_DIR) -> dict[str, Any]:
    """The resolved plain-dict tree for `overrides` (e.g. `["+experiment=smoke"]`)."""
    register_schema_defaults()
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        cfg = compose(config_name=CONFIG_NAME, overrides=list(overrides))
    return to_plain_dict(cfg)


def to_plain_dict(cfg: DictConfig) -> dict[str, Any]:
    """The resolved tree without Hydra's own `hydra` node (a composed tree's keys are strings)."""
    container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    assert isinstance(container, dict)
    return {str(key): value for key, value in container.items() if key != "hydra"}


def experiment_names() -> list[str]:
    return sorted(path.stem for path in (CONFIG_DIR / "experiment").glob("*.yaml"))

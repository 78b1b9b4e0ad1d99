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

Hydra keeps the working directory (`hydra.job.chdir: false`), so a relative path in a config is
read from wherever the command was started, and a Ray worker or a child process starts elsewhere
again. A value that points into this checkout (the CPU stand-ins of `cpu_standins/`, the venvs
`make` builds) is written `${repo_path:cpu_standins/sglang_server}` instead: the resolver
:func:`repo_path` makes it absolute at composition, the same from any directory.
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

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO_ROOT / "conf"
REPO_PATH_RESOLVER = "repo_path"
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


def repo_path(relative: str) -> str:
    """`${repo_path:<relative>}`: the absolute path of `relative` inside this checkout (the folder
    holding conf/). An absolute path is refused: it would not mean what the resolver's name says."""
    if Path(relative).is_absolute():
        raise ValueError(
            f"${{{REPO_PATH_RESOLVER}:{relative}}}: the path must be relative to the repository "
            f"root ({REPO_ROOT}); write an absolute path without the resolver"
        )
    return str(REPO_ROOT / relative)


def register_resolvers() -> None:
    """Make `${repo_path:...}` known to OmegaConf in this process (idempotent). Resolving happens
    where a composed tree is turned into plain values (:func:`to_plain_dict`), which may be
    another process than the composing one (a sweep point on Slurm), so both register it."""
    if not OmegaConf.has_resolver(REPO_PATH_RESOLVER):
        OmegaConf.register_new_resolver(REPO_PATH_RESOLVER, repo_path)


def register_schema_defaults() -> None:
    """Store the schema's defaults in Hydra's ConfigStore (idempotent: a node is replaced), and
    register the resolvers conf/ uses."""
    register_resolvers()
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
    register_resolvers()
    container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    assert isinstance(container, dict)
    return {str(key): value for key, value in container.items() if key != "hydra"}


def experiment_names() -> list[str]:
    return sorted(path.stem for path in (CONFIG_DIR / "experiment").glob("*.yaml"))

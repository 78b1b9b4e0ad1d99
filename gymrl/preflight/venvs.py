"""The environments this checkout's Makefile makes (`make sglang-venv`, `make megatron-venv`,
`make gym-venv`), looked for before a run starts anything.

The CPU experiments find their interpreters inside the checkout
(`${repo_path:.venv-sglang/bin/python}`, conf/generation/sglang_cpu.yaml), so that they run as
written once `make` has made them. Without this look, a missing one shows late and far from its
cause: the SGLang server's start failing after the Gym deployment came up, or Ray's raylet unable
to start the trainer's worker (`No such file or directory` in a worker log, then the trainer's
start-up deadline). So the dry run names each missing one with the make target that makes it,
and a run stops before it starts anything.

Only interpreters inside the checkout's venv folders are looked for: an interpreter elsewhere (a
cluster's `/opt/envs/...`) may exist on the workers' nodes only. Gym's venv is looked for wherever
`env.gym.venv` says, as the Gym shards' start does: the driver's machine launches Gym from it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from gymrl.config.compose import REPO_ROOT
from gymrl.config.schema.generation import SGLangGenerationConfig
from gymrl.config.schema.recipe import RecipeConfig
from nemo_gym_ext.gym_launch import GYM_VENV_TARGET, GymVenvMissingError, gym_launcher

# The Makefile's venv folders (its SGLANG_VENV and MEGATRON_VENV defaults, relative to the
# repository root) and the targets that make them.
MAKE_TARGETS = {".venv-sglang": "sglang-venv", ".venv-megatron": "megatron-venv"}


@dataclass(frozen=True)
class MissingVenv:
    """A config key whose environment is not on this machine, and the make target for it."""

    key: str
    path: str
    target: str

    def render(self) -> str:
        return (
            f"{self.key} = {self.path!r}: not there, and this machine runs it; make it with "
            f"`make {self.target}` in {REPO_ROOT}, or point {self.key} at one that exists"
        )


def missing_venvs(config: RecipeConfig) -> list[MissingVenv]:
    """Each interpreter or Gym venv the run needs on this machine that is not there."""
    interpreters = [
        (f"cluster.roles.{role}.python", getattr(config.cluster.roles, role).python)
        for role in type(config.cluster.roles).model_fields
    ]
    if isinstance(config.generation, SGLangGenerationConfig):
        interpreters.append(("generation.launch.python", config.generation.launch.python))
    missing = [
        MissingVenv(key, python, target)
        for key, python in interpreters
        if python is not None
        and (target := _make_target(python)) is not None
        and not Path(python).is_file()
    ]
    if config.env.source == "gym_launch":
        try:
            gym_launcher(Path(config.env.gym.venv))
        except GymVenvMissingError:
            target = GYM_VENV_TARGET.removeprefix("make ")
            missing.append(MissingVenv("env.gym.venv", config.env.gym.venv, target))
    return missing


def _make_target(python: str) -> str | None:
    """The target that makes `python`, when it lies in one of the checkout's venv folders. Not
    resolved: a venv folder may be a link to one made elsewhere, and its `bin/python` is one."""
    path = Path(os.path.abspath(python))
    if not path.is_relative_to(REPO_ROOT):
        return None
    return MAKE_TARGETS.get(path.relative_to(REPO_ROOT).parts[0])


def render_missing(missing: list[MissingVenv]) -> str:
    """What the dry run prints, and a run refuses to start with."""
    targets = " ".join(dict.fromkeys(venv.target for venv in missing))
    body = "\n".join(f"  - {venv.render()}" for venv in missing)
    return f"environments missing on this machine (`make {targets}` makes them):\n{body}"

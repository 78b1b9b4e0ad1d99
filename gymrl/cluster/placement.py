"""Where every role of a run goes, decided once from the config, before any actor starts.

The roles are the generation engines (one torch engine inside the policy server, or
`generation.num_engines` SGLang servers of `tensor_parallel_size` GPUs each), the trainer (one
torch actor, or one Megatron rank per GPU), the Gym shards and the replay buffer. Roles are not
colocated: SGLang and Megatron get GPUs of their own.

:func:`plan_placement` is pure (no Ray, no torch): it is what the dry-run plan prints and what the
unit tests check. Every GPU role's bundles sit in **one** placement group (:func:`reserve`), so
Ray places them all at once and the result does not depend on which actor starts first. Bundles
that need a whole node (Megatron's, so that a tensor-parallel group shares NVLink) leave the other
bundles the remaining nodes; Ray schedules the largest bundles first.

The torch roles use one GPU each when the cluster has GPUs (`cluster.gpus_per_node > 0`): the
engine and the trainer on two GPUs, or sharing the only one (half of it each, in Ray's
accounting); a torch trainer next to SGLang engines takes a GPU the engines leave, else the CPU.
On a CPU-only cluster nothing is reserved and every actor asks Ray for no CPU either (`num_cpus=0`):
on a 2-core machine four actors could never be placed otherwise; each bounds its own threads.

Each role also carries its environment (`cluster.roles.<role>`: an interpreter or a container
image), which :func:`actor_options`, the one place that builds actors' options, hands to Ray as
the actor's `runtime_env`: one Ray cluster runs SGLang, Megatron and the core roles, each in the
interpreter its pinned packages are installed in. Its `node_labels` choose the Ray nodes the role
runs on: the label selector of its bundles in the placement group, or of its actors where they
have none (CPU actors), so generation and training can be put on nodes of their own.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from gymrl.config.schema.cluster import RoleEnvironmentConfig
from gymrl.config.schema.generation import SGLangGenerationConfig, TorchGenerationConfig
from gymrl.config.schema.recipe import RecipeConfig
from gymrl.config.schema.trainer import MegatronTrainerConfig


@dataclass(frozen=True)
class RolePlacement:
    """The actors of one role: how many GPUs and CPUs each asks Ray for, in which bundle of the
    run's placement group each one goes (empty: not in the placement group) and the interpreter
    or image they run in (`cluster.roles.<role>`; unset: the driver's interpreter)."""

    gpus_per_actor: float
    cpus_per_actor: float
    bundle_of_actor: tuple[int, ...] = ()
    environment: RoleEnvironmentConfig = field(default_factory=RoleEnvironmentConfig)

    @property
    def device(self) -> str:
        """The torch device of an actor of this role: Ray gives it its GPU as `cuda`."""
        return "cuda" if self.gpus_per_actor > 0 else "cpu"


_CPU_ROLE = RolePlacement(gpus_per_actor=0.0, cpus_per_actor=0.0)


@dataclass(frozen=True)
class Placement:
    """Every role's placement. `bundles` is the run's one placement group (none when empty);
    `bundle_labels[i]` is the label selector of bundle `i` (its role's `node_labels`).

    `generation`: the engines: the torch engine (inside the policy server) or the SGLang servers
    (one actor per engine). `policy_server`: the actor serving the OpenAI API, which holds the
    torch engine (same placement) or talks to the SGLang servers (no GPU). `trainer`: the torch
    trainer (one actor) or the Megatron ranks, actor `r` being global rank `r`.
    """

    bundles: tuple[dict[str, float], ...]
    generation: RolePlacement
    policy_server: RolePlacement
    trainer: RolePlacement
    gym_shards: RolePlacement = _CPU_ROLE
    buffer: RolePlacement = _CPU_ROLE
    bundle_labels: tuple[dict[str, str], ...] = ()


def generation_gpus(config: RecipeConfig) -> int:
    """GPUs the generation engines run on (a torch engine's may be shared with the trainer; one
    with `generation.device: cpu` takes none)."""
    generation = config.generation
    if isinstance(generation, SGLangGenerationConfig):
        return generation.num_gpus
    return 1 if config.cluster.total_gpus and generation.device == "auto" else 0


def trainer_gpus(config: RecipeConfig) -> int:
    """GPUs the trainer runs on: Megatron takes every GPU generation leaves; the torch trainer
    one, when there is one (shared with a torch engine on a one-GPU cluster)."""
    left = config.cluster.total_gpus - generation_gpus(config)
    if isinstance(config.trainer, MegatronTrainerConfig):
        return left
    if isinstance(config.generation, TorchGenerationConfig):
        return 1 if config.cluster.total_gpus else 0
    return 1 if left > 0 else 0


def shares_one_gpu(config: RecipeConfig) -> bool:
    """The torch engine and the torch trainer share a one-GPU cluster."""
    return (
        isinstance(config.generation, TorchGenerationConfig)
        and config.generation.device == "auto"
        and not isinstance(config.trainer, MegatronTrainerConfig)
        and config.cluster.total_gpus == 1
    )


def trainer_node_bundles(world_size: int, gpus_per_node: int) -> list[dict[str, float]]:
    """Megatron's bundles: whole nodes, so consecutive ranks (the TP group) share NVLink;
    `world_size` must fill them."""
    per_node = min(world_size, gpus_per_node)
    if per_node < 1 or world_size % per_node:
        raise ValueError(
            f"{world_size} trainer GPUs do not fill nodes of {gpus_per_node} GPUs; give the "
            "trainer whole nodes (or fewer GPUs than one node)"
        )
    return [{"GPU": float(per_node), "CPU": float(per_node)}] * (world_size // per_node)


def plan_placement(config: RecipeConfig, *, with_trainer: bool = True) -> Placement:
    """The placement of every role of a validated config; without the trainer's GPUs when
    nothing trains (`with_trainer=False`: an eval, whose trainer role is then left unplaced)."""
    bundles: list[dict[str, float]] = []
    bundle_labels: list[dict[str, str]] = []
    roles = config.cluster.roles

    def add(new: list[dict[str, float]], labels: dict[str, str]) -> list[int]:
        bundles.extend(new)
        bundle_labels.extend(dict(labels) for _ in new)
        return list(range(len(bundles) - len(new), len(bundles)))

    generation = config.generation
    # A torch engine lives inside the policy server, so it runs in the policy server's environment.
    sglang = isinstance(generation, SGLangGenerationConfig)
    engine_labels = (roles.generation if sglang else roles.policy_server).node_labels
    if isinstance(generation, SGLangGenerationConfig) and generation.launch.device == "cpu":
        generation_role = server_role = _CPU_ROLE  # real SGLang servers on the CPU (docs)
    elif isinstance(generation, SGLangGenerationConfig):
        tp = generation.tensor_parallel_size
        engines = add([{"GPU": float(tp), "CPU": 1.0}] * generation.num_engines, engine_labels)
        generation_role = RolePlacement(float(tp), 1.0, tuple(engines))
        server_role = _CPU_ROLE
    elif generation_gpus(config):
        share = 0.5 if shares_one_gpu(config) else 1.0
        engine = tuple(add([{"GPU": 1.0}], engine_labels))
        generation_role = server_role = RolePlacement(share, 0.0, engine)
    else:
        generation_role = server_role = _CPU_ROLE

    world_size = trainer_gpus(config)
    trainer_labels = roles.trainer.node_labels
    if not with_trainer:
        trainer_role = _CPU_ROLE
    elif isinstance(config.trainer, MegatronTrainerConfig):
        nodes = add(trainer_node_bundles(world_size, config.cluster.gpus_per_node), trainer_labels)
        per_node = min(world_size, config.cluster.gpus_per_node)
        trainer_role = RolePlacement(
            1.0, 1.0, tuple(nodes[rank // per_node] for rank in range(world_size))
        )
    elif shares_one_gpu(config):
        trainer_role = RolePlacement(0.5, 0.0, generation_role.bundle_of_actor)
    elif world_size:
        trainer_role = RolePlacement(1.0, 0.0, tuple(add([{"GPU": 1.0}], trainer_labels)))
    else:
        trainer_role = _CPU_ROLE

    return Placement(
        tuple(bundles),
        generation=replace(
            generation_role, environment=roles.generation if sglang else roles.policy_server
        ),
        policy_server=replace(server_role, environment=roles.policy_server),
        trainer=replace(trainer_role, environment=roles.trainer),
        gym_shards=replace(_CPU_ROLE, environment=roles.gym_shards),
        buffer=replace(_CPU_ROLE, environment=roles.buffer),
        bundle_labels=tuple(bundle_labels),
    )


# ------------------------------------------------------------------------------- with Ray
def reserve(placement: Placement, timeout_s: float) -> Any:
    """Create the run's placement group and wait until Ray has placed it (None without GPUs)."""
    if not placement.bundles:
        return None
    from ray.util.placement_group import placement_group

    bundles, labels = list(placement.bundles), list(placement.bundle_labels)
    if any(labels):
        group = placement_group(bundles, strategy="PACK", bundle_label_selector=labels)
    else:  # no selector at all (Ray refuses an empty list beside bundles)
        group = placement_group(bundles, strategy="PACK")
    if not group.wait(timeout_s):
        raise TimeoutError(
            f"Ray could not place the run's GPU bundles {list(placement.bundles)} within "
            f"{timeout_s} s (label selectors {labels}); check `ray status` against "
            "cluster.num_nodes, cluster.gpus_per_node and cluster.roles.<role>.node_labels"
        )
    return group


def runtime_env(
    environment: RoleEnvironmentConfig, env_vars: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The Ray `runtime_env` of an actor running in `environment` with `env_vars` (empty: the
    driver's interpreter, nothing to set).

    `py_executable` is a command line Ray runs through `bash -c`, hence the quoting. Ray allows
    only `env_vars` (and `config`) next to `image_uri`, which is all this adds (the validator
    refuses a setup hook with an image). `python_path` goes first on the worker's PYTHONPATH,
    before the one it inherits: Ray expands `${PYTHONPATH}` in `env_vars` from the environment
    the worker is started in (`ray._private.utils.update_envs`)."""
    env: dict[str, Any] = {}
    if environment.python is not None:
        env["py_executable"] = shlex.quote(environment.python)
    if environment.image is not None:
        env["image_uri"] = environment.image
    if environment.setup_hook is not None:
        env["worker_process_setup_hook"] = environment.setup_hook
    variables = dict(env_vars or {})
    if environment.python_path:
        variables["PYTHONPATH"] = os.pathsep.join([*environment.python_path, "${PYTHONPATH}"])
    if variables:
        env["env_vars"] = variables
    return env


def _setup_hook_as_ray_runs_it(env: dict[str, Any]) -> dict[str, Any]:
    """Ray runs a `worker_process_setup_hook` only from the job's runtime_env (`ray.init`), which
    turns a module path into an environment variable of every worker; in an actor's runtime_env
    the field alone does nothing (Ray 2.60, `_private/runtime_env/setup_hook.py`). So each actor's
    is turned into that variable here, by Ray's own function for it."""
    hook = env.get("worker_process_setup_hook")
    if hook is None:
        return env
    from ray._private.runtime_env.setup_hook import export_setup_func_module

    return export_setup_func_module(dict(env) | {"env_vars": dict(env.get("env_vars", {}))}, hook)


def actor_options(
    role: RolePlacement, index: int, group: Any, env_vars: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """`.options(...)` of actor `index` of `role`: its GPUs and CPUs, its role's interpreter or
    image and `env_vars` (the actor's `runtime_env`, when there is one) and, when it has a
    bundle, the scheduling strategy that puts it there (the bundle carries the role's node
    labels), else the role's node labels as its label selector.

    An actor started by another actor inherits its parent's `runtime_env` field by field unless
    it sets its own; the validator makes sure the SGLang servers, which the policy server starts,
    set the same fields as their parent whenever it has any (`gymrl.preflight.rules.cluster`)."""
    options: dict[str, Any] = {"num_gpus": role.gpus_per_actor, "num_cpus": role.cpus_per_actor}
    env = runtime_env(role.environment, env_vars)
    if env:
        options["runtime_env"] = _setup_hook_as_ray_runs_it(env)
    if role.bundle_of_actor:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=role.bundle_of_actor[index]
        )
    elif role.environment.node_labels:
        options["label_selector"] = dict(role.environment.node_labels)
    return options

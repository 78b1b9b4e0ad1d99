"""Rules on `cluster.roles` (`gymrl.config.schema.cluster`): what Ray's `runtime_env` can run
(`gymrl.cluster.placement.runtime_env`).

An interpreter, and each folder of a role's python_path, is found by its absolute path on every
node (a relative one would resolve against each worker's directory); Ray runs an image alone, so
a role has an interpreter or an image. A role's environment only makes sense for a role with
actors of its own: a torch engine runs inside the policy server. Node labels match by equality
(the run checks that some node carries them before any role starts). The SGLang servers are started
by the policy server, and Ray hands a child actor every `runtime_env` field of its parent that it
does not set itself: they must set the same field, or they would run in the policy server's
environment (or in a mix of an interpreter and an image)."""

from __future__ import annotations

from pathlib import PurePosixPath

from gymrl.config.schema.cluster import RoleEnvironmentConfig
from gymrl.config.schema.generation import TorchGenerationConfig
from gymrl.config.schema.recipe import RecipeConfig
from nemo_gym_ext.config_errors import ConfigIssue


def role_environments(config: RecipeConfig) -> list[ConfigIssue]:
    """Each role's environment on its own, role by role."""
    roles = config.cluster.roles
    return [
        issue
        for role in type(roles).model_fields
        for check in (
            _absolute_interpreter,
            _absolute_python_path,
            _no_hook_beside_an_image,
            _interpreter_or_image,
            _labels_by_equality,
        )
        for issue in check(f"cluster.roles.{role}", getattr(roles, role))
    ]


def torch_engine_has_no_generation_role(config: RecipeConfig) -> list[ConfigIssue]:
    generation = config.cluster.roles.generation
    if not isinstance(config.generation, TorchGenerationConfig):
        return []
    set_fields = [
        (field, value)
        for field, value in (
            (generation.kind, generation.python or generation.image),
            ("node_labels", generation.node_labels),
        )
        if field is not None and value
    ]
    return [
        ConfigIssue(
            f"cluster.roles.generation.{field}",
            value,
            "generation=torch has no generation actors: the torch engine runs inside the "
            "policy server",
            f"set cluster.roles.policy_server.{field} instead, or select generation=sglang",
        )
        for field, value in set_fields
    ]


def sglang_servers_set_the_policy_servers_field(config: RecipeConfig) -> list[ConfigIssue]:
    roles = config.cluster.roles
    generation, server = roles.generation, roles.policy_server
    if (
        isinstance(config.generation, TorchGenerationConfig)
        or server.kind is None
        or generation.kind == server.kind
    ):
        return []
    outcome = (
        "in the policy server's environment"
        if generation.kind is None
        else "with both an interpreter and an image"
    )
    return [
        ConfigIssue(
            f"cluster.roles.generation.{server.kind}",
            None,
            f"required when cluster.roles.policy_server.{server.kind} is set: the SGLang "
            "servers, which the policy server starts, inherit every runtime_env field they "
            f"do not set themselves, so they would run {outcome}",
            f"give the SGLang environment as cluster.roles.generation.{server.kind} (and "
            f"nothing else there), or set cluster.roles.policy_server.{server.kind}=null",
        )
    ]


def _absolute_interpreter(key: str, environment: RoleEnvironmentConfig) -> list[ConfigIssue]:
    if environment.python is None or PurePosixPath(environment.python).is_absolute():
        return []
    return [
        ConfigIssue(
            f"{key}.python",
            environment.python,
            "must be an absolute path: Ray starts the role's workers with it on every "
            "node, from their own working directories",
            "give the absolute path of the environment's interpreter, e.g. "
            "/opt/envs/sglang/bin/python",
        )
    ]


def _absolute_python_path(key: str, environment: RoleEnvironmentConfig) -> list[ConfigIssue]:
    relative = [path for path in environment.python_path if not PurePosixPath(path).is_absolute()]
    if not relative:
        return []
    return [
        ConfigIssue(
            f"{key}.python_path",
            list(environment.python_path),
            f"{', '.join(map(repr, relative))} must be absolute: the role's workers start on "
            "every node from their own working directories",
            "give absolute folders, e.g. ${repo_path:cpu_standins/megatron_trainer} for one "
            "inside this checkout",
        )
    ]


def _no_hook_beside_an_image(key: str, environment: RoleEnvironmentConfig) -> list[ConfigIssue]:
    if environment.setup_hook is None or environment.image is None:
        return []
    return [
        ConfigIssue(
            f"{key}.setup_hook",
            environment.setup_hook,
            "Ray takes nothing but env_vars next to an image (runtime_env image_uri)",
            f"run the hook from the image's own startup, or set {key}.image to null",
        )
    ]


def _interpreter_or_image(key: str, environment: RoleEnvironmentConfig) -> list[ConfigIssue]:
    if environment.python is None or environment.image is None:
        return []
    return [
        ConfigIssue(
            f"{key}.image",
            environment.image,
            f"exclusive with {key}.python: Ray runs an image with the image's own interpreter",
            f"set one of {key}.python and {key}.image to null",
        )
    ]


def _labels_by_equality(key: str, environment: RoleEnvironmentConfig) -> list[ConfigIssue]:
    operators = {
        label: value
        for label, value in environment.node_labels.items()
        if value.startswith("!") or value.startswith("in(")
    }
    if not operators:
        return []
    return [
        ConfigIssue(
            f"{key}.node_labels",
            dict(environment.node_labels),
            f"{operators} use Ray's selector operators; node labels here match by equality, "
            "which is what the run checks against the nodes before any role starts",
            "name the value each node must carry (launch/ray.sub's slurm-node or "
            "slurm-node-index), one key per label",
        )
    ]

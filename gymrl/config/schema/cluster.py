"""`cluster.*` (conf/cluster/): the Ray cluster's size, and the interpreter or container image
each role's actors run in and the Ray nodes they may run on (`cluster.roles.*`)."""

from __future__ import annotations

from pydantic import Field

from gymrl.config.schema.base import Strict


class RoleEnvironmentConfig(Strict):
    """The interpreter or container one role's Ray actors run in, and the nodes they may run on.
    The roles' pinned environments conflict with each other (SGLang's and Megatron's torch and
    transformers), so one Ray cluster runs each role in its own; `gymrl.cluster.placement.
    actor_options` turns this into the actors' Ray `runtime_env` and label selector. Rules
    spanning fields are in `gymrl.preflight.rules.cluster`."""

    python: str | None = Field(
        default=None,
        description="Absolute path of the Python executable of this role's environment (e.g. "
        "a venv's bin/python), present on every node; Ray starts the role's actors with it "
        "(runtime_env py_executable). It needs the driver's Ray and Python versions and gymrl. "
        "null (and image null) = the interpreter Ray was started with (the driver's).",
    )
    image: str | None = Field(
        default=None,
        description="Container image the role's actors run in (Ray runtime_env image_uri: "
        "podman on every node, the image holding the driver's Ray and Python versions and "
        "gymrl). Exclusive with python.",
    )
    setup_hook: str | None = Field(
        default=None,
        description="Dotted path (module.function) of a function Ray calls once in each worker "
        "process of this role before any of its actors is built (runtime_env "
        "worker_process_setup_hook), for what must hold for the whole process; the module must "
        "be importable there (python_path). Not with image. +experiment=flagship_cpu points the "
        "trainer's at megatron-core's CPU device shim (cpu_standins/megatron_trainer).",
    )
    python_path: tuple[str, ...] = Field(
        default=(),
        description="Absolute folders put first on PYTHONPATH of this role's workers, before "
        "the PYTHONPATH they inherit (runtime_env env_vars), present on every node: where "
        "setup_hook's module lives when the role's environment does not install it. "
        "+experiment=flagship_cpu gives the trainer ${repo_path:cpu_standins/megatron_trainer}.",
    )

    node_labels: dict[str, str] = Field(
        default_factory=dict,
        description="Ray node labels this role's actors must run on, each key equal to its "
        "value (Ray's label selector; GPU bundles of the role get it as their bundle label "
        "selector). launch/ray.sub labels every node with its Slurm name and its index in the "
        "allocation (0 = the head): {slurm-node-index: '1'} puts the role on the second node. "
        "Quote numbers: labels are strings. Empty = any node Ray chooses. A run stops before "
        "any role starts when no node carries them.",
    )

    @property
    def kind(self) -> str | None:
        """Which of the two is set: 'python', 'image' or None (the driver's interpreter)."""
        if self.python is not None:
            return "python"
        return "image" if self.image is not None else None


class RoleEnvironmentsConfig(Strict):
    """One environment (and node choice) per role, named like the roles of
    `gymrl.cluster.placement.Placement`."""

    generation: RoleEnvironmentConfig = Field(
        default_factory=RoleEnvironmentConfig,
        description="The SGLang server actors (generation=sglang only: a torch engine runs "
        "inside the policy server).",
    )
    policy_server: RoleEnvironmentConfig = Field(
        default_factory=RoleEnvironmentConfig,
        description="The policy server (the OpenAI API; with generation=torch it holds the "
        "engine).",
    )
    trainer: RoleEnvironmentConfig = Field(
        default_factory=RoleEnvironmentConfig,
        description="The trainer: the torch trainer actor or every Megatron rank.",
    )
    gym_shards: RoleEnvironmentConfig = Field(
        default_factory=RoleEnvironmentConfig, description="The Gym shards."
    )
    buffer: RoleEnvironmentConfig = Field(
        default_factory=RoleEnvironmentConfig, description="The replay buffer."
    )


class ClusterConfig(Strict):
    num_nodes: int = Field(default=1, gt=0, description="Nodes of the Ray cluster.")
    gpus_per_node: int = Field(
        default=0,
        ge=0,
        description="GPUs per node (0 = CPU only). A local Ray (ray_address null) is started "
        "with this many, whatever it detects: more than the machine has only works for roles "
        "whose setup_hook maps CUDA to the CPU (+experiment=flagship_cpu).",
    )
    cpus_per_node: int | None = Field(
        default=None, gt=0, description="CPUs Ray may use per node; null = all."
    )
    ray_address: str | None = Field(
        default=None, description="Existing Ray cluster ('auto' on Slurm); null = start locally."
    )
    ray_start_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="Deadline for the cluster at ray_address to accept a connection before the "
        "run joins it (ray.init itself takes none), for the placement group to be reserved and "
        "for the Gym shards and the policy server to start.",
    )
    roles: RoleEnvironmentsConfig = Field(
        default_factory=RoleEnvironmentsConfig,
        description="Per role, the interpreter or container image its Ray actors run in, and "
        "the Ray nodes they may run on.",
    )

    @property
    def total_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

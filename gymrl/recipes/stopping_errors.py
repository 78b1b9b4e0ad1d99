"""The errors that stop a run with a message a user can act on: the entry points print them in
one line, without a traceback, and exit 1 (`gymrl.recipes.entry.train`, `run_eval`). Anything
else is a bug and keeps its traceback.

One tuple in a module of its own, because it gathers errors from every room a run passes through
(the cluster, the run folder, the rows, Gym, the engine, the trainer's gate) and the recipes that
catch them should not have to import each other, or those rooms, for it.
"""

from __future__ import annotations

from ray.exceptions import RayActorError

from gymrl.cluster.session import ClusterUnavailableError
from gymrl.experience.held_out import HeldOutRowsRefusedError
from gymrl.experience.producer import EveryPromptRefusedError
from gymrl.experience.rows import UnservedAgentError
from gymrl.generation.server.api_key import ApiKeyError
from gymrl.generation.types import EngineFailedError
from gymrl.run.folder import RunFolderInUseError
from gymrl.run.progress import NoProgressError
from gymrl.trainer.parity_gate import ParityGateError
from nemo_gym_ext.gym_launch import GymStartError, GymVenvMissingError
from nemo_gym_ext.postprocess import MalformedGymResultError, NonContiguousEpisodeError
from nemo_gym_ext.rollout import RolloutBudgetExceeded, UnknownAgentError

RUN_STOPPING_ERRORS = (
    ClusterUnavailableError,
    ApiKeyError,
    RunFolderInUseError,
    NonContiguousEpisodeError,
    MalformedGymResultError,
    UnknownAgentError,
    UnservedAgentError,
    RolloutBudgetExceeded,
    TimeoutError,
    # A role's process died (killed, out of memory, its node lost): the message names the actor.
    RayActorError,
    GymVenvMissingError,
    GymStartError,
    ParityGateError,
    EveryPromptRefusedError,
    HeldOutRowsRefusedError,
    NoProgressError,
    # The torch engine stopped after a failed step: its own error, not the agents' failures.
    EngineFailedError,
)

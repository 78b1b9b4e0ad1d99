"""A history policy for Gym's compaction agent that keeps only the latest tool outputs.

NeMo-Gym 0.7.0's built-in policy (`recency`) compacts reasoning blocks and images only; a model
that writes no reasoning and reads no images (SmolLM2) never has its context compacted by it. The
pattern agent harnesses use for long tool episodes (SWE agents drop old observations) is this
one: keep the last `keep_last_outputs` tool outputs, and write a short marker in place of each
older one, so the model still sees that a call was answered. Outputs that condition the next call
(the answers to the call just made) are always kept, whatever the window. The tool outputs of the
row's own input (a solved example's) are kept too unless `protect_initial_context` is false:
then they count as the oldest outputs of the window, so a one-call episode is compacted at its
second call already (what a small model that calls one tool and answers needs to be compacted at
all; `+experiment=compaction_gym`).

Each output replaced changes the request's history in the middle, so the agent declares a new
segment there (`context_compaction_contract`) and starts that call with
`required_prefix_token_ids: null`. Gym's materialiser writes a marker as a message of the replaced
item's role, `user` for a tool output (which has none): the model sees its call, then the marker.

Registered with the agent at import (`register`, run by this package's `app.py`) under
:data:`POLICY_NAME`; an agent config selects it with
`context_history: {enabled: true, policy: {type: tool_output_recency, config: {...}}}`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from responses_api_agents.simple_agent_with_compaction.compaction import (
    HistoryPolicy,
    PolicyDecisionRecord,
    SemanticHistory,
    canonical_digest,
    register_history_policy,
)
from responses_api_agents.simple_agent_with_compaction.compaction.history import (
    HistoryViewPlan,
    KeepPartRef,
    LineageDisposition,
    OmissionArtifact,
    _config_digest,
    _lineage_record,
    _ordered_id_digest,
    _semantic_part_digest,
)

POLICY_NAME = "tool_output_recency"
TOOL_OUTPUT = "function_call_output"


class ToolOutputRecencyConfig(BaseModel):
    """The policy's `config` in the agent's `context_history.policy`."""

    model_config = ConfigDict(extra="forbid")

    keep_last_outputs: int = Field(
        default=1,
        ge=0,
        description="Tool outputs kept whole, the latest ones; those the next call answers to "
        "are kept besides.",
    )
    protect_initial_context: bool = Field(
        default=True,
        description="Keep the tool outputs of the row's own input whatever the window; false "
        "counts them as the window's oldest.",
    )
    marker: str = Field(
        default="[earlier tool output omitted]",
        min_length=1,
        description="The text written in place of each older tool output.",
    )


class ToolOutputRecencyPolicy:
    """Keeps the latest tool outputs and replaces each older one by a marker (module docstring).
    Deterministic in the history and the config, as Gym's policies must be (a retried call
    must prepare the same view)."""

    name = POLICY_NAME
    version = "1"

    def __init__(self, config: ToolOutputRecencyConfig):
        self.config = config
        self._digest = _config_digest({"type": self.name, "config": config.model_dump(mode="json")})

    def plan(self, history: SemanticHistory, *, decision_turn: int) -> HistoryViewPlan:
        protect = self.config.protect_initial_context
        outputs = [
            part.part_id
            for event, part in history.parts
            if event.item.get("type") == TOOL_OUTPUT and not (protect and event.is_initial_context)
        ]
        pending = {
            part.part_id
            for event, part in history.parts
            if event.item.get("type") == TOOL_OUTPUT
            and event.conditions_action_turn == decision_turn
        }
        window = self.config.keep_last_outputs
        recent = set(outputs[len(outputs) - window :]) if window else set()
        omitted = [part_id for part_id in outputs if part_id not in recent | pending]
        artifacts = {part_id: self._marker_for(part_id) for part_id in omitted}

        keep: list[KeepPartRef] = []
        dispositions: dict[str, tuple[LineageDisposition, tuple[str, ...], tuple[str, ...]]] = {}
        for event, part in history.parts:
            artifact = artifacts.get(part.part_id)
            if artifact is None:
                keep.append(KeepPartRef(event.event_id, part.part_id))
                digest = _semantic_part_digest(event, part)
                dispositions[part.part_id] = ("kept", (part.part_id,), (digest,))
            else:
                marker_digest = canonical_digest(
                    {
                        "type": "omission_marker",
                        "artifact_id": artifact.artifact_id,
                        "text": artifact.text,
                    }
                )
                dispositions[part.part_id] = ("replaced", (artifact.artifact_id,), (marker_digest,))
        retained = tuple(ref.part_id for ref in keep)
        decision = PolicyDecisionRecord(
            policy_name=self.name,
            policy_version=self.version,
            config_digest=self._digest,
            protected_part_ids=tuple(sorted(pending)),
            changed_part_ranges=tuple((part_id, part_id) for part_id in omitted),
            retained_part_count=len(retained),
            omitted_part_count=len(omitted),
            selection_digest=_ordered_id_digest((*retained, "--omitted--", *omitted)),
            inserted_artifact_ids=tuple(artifact.artifact_id for artifact in artifacts.values()),
            decision_turn=decision_turn,
            lineage=_lineage_record(
                history,
                transformation_type=self.name,
                transformation_version=self.version,
                configuration_digest=self._digest,
                disposition_by_part_id=dispositions,
                lossy=bool(omitted),
            ),
        )
        return HistoryViewPlan(
            keep=tuple(keep), artifacts=tuple(artifacts.values()), decision=decision
        )

    def _marker_for(self, part_id: str) -> OmissionArtifact:
        """The marker of one replaced output, anchored where the output was."""
        return OmissionArtifact(
            artifact_id=f"omission-{self._digest[:12]}-{part_id}",
            source_first_part_id=part_id,
            source_last_part_id=part_id,
            source_part_count=1,
            source_digest=_ordered_id_digest((part_id,)),
            text=self.config.marker,
            anchor_part_id=part_id,
        )


def build(config: dict) -> HistoryPolicy:
    """The factory Gym calls with the policy's `config` mapping (validated here)."""
    return ToolOutputRecencyPolicy(ToolOutputRecencyConfig.model_validate(config))


def register() -> None:
    """Make :data:`POLICY_NAME` selectable by this process's compaction agent."""
    register_history_policy(POLICY_NAME, build, replace_existing=True)

"""Which clients of the policy server send earlier turns back with their token ids, by shard.

Whether an episode's history can drift from what was sampled depends on the client as much as on
the template: a client that sends each assistant turn back with its `prompt_token_ids` and
`generation_token_ids` (the built-in agents by default; Gym's vllm_model adapter with
`return_token_id_information: true`, which the recipe sets on the deployments it launches) has
its turns kept verbatim by the policy server, unless `generation.server.honor_prompt_token_ids`
is false; a client that sends text only has its history re-rendered by the template. A joined
Gym deployment or a remote agent decides for itself, so the recipe cannot say.
"""

from __future__ import annotations

from dataclasses import dataclass

from gymrl.config.schema.recipe import RecipeConfig
from nemo_gym_ext.config import AGENTS_KEY, GymActorConfig

HONOR_KEY = "generation.server.honor_prompt_token_ids"


@dataclass(frozen=True)
class Client:
    """One agent (or one shard's Gym deployment) calling the policy server.

    `sends_ids` is None where the recipe cannot know; `key` is the field that decides it (None
    where the recipe has none), so a refusal can name it.
    """

    name: str
    sends_ids: bool | None
    key: str | None

    @property
    def text_only(self) -> bool:
        """Certainly sends text only: the server re-renders this client's history."""
        return self.sends_ids is False


def shard_clients(config: RecipeConfig, shard: GymActorConfig) -> list[Client]:
    """The clients of one shard, as its source says they send their turns back."""
    if shard.source == "gym_launch":
        return [Client("the launched Gym deployment", True, None)]
    if shard.source == "gym_join":
        return [Client("the joined Gym deployment", None, None)]
    clients = []
    for name, spec in shard.agents.items():
        if spec.url is not None:
            clients.append(Client(name, None, None))
            continue
        options = spec.agent_options(policy_model=config.policy.name)
        key = f"{shard.key_prefix}.{AGENTS_KEY}.{name}.options.send_token_ids"
        clients.append(Client(name, options.send_token_ids, key))
    return clients


def describe_clients(config: RecipeConfig, clients: list[Client]) -> str:
    """How the clients' turns reach the prompt, for the plan."""
    if not config.generation.server.honor_prompt_token_ids:
        return f"text only (the server re-tokenises every history: {HONOR_KEY}=false)"
    by_kind: dict[str, list[str]] = {}
    for client in clients:
        kind = {True: "ids sent back", False: "text only", None: "unknown to the recipe"}[
            client.sends_ids
        ]
        by_kind.setdefault(kind, []).append(client.name)
    return "; ".join(f"{kind}: {', '.join(names)}" for kind, names in by_kind.items())

"""Rules on `env.nemo_gym` that need its Gym shards built (`RecipeConfig.gym_shards`): each shard's
truncation settings against the policy server's, the loss's and the policy's chat template, and
its compaction agents against the model server the recipe injects (`env.gym.policy_adapter`).
Each such rule takes the config and the shards; the shards' own keys are checked where they are
built (`nemo_gym_ext.config.build_gym_actor_config`). One rule on `env.gym` alone, the server
roots a launched deployment searches, takes the config only."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import yaml

from gymrl.config.schema.recipe import RecipeConfig
from gymrl.preflight.token_id_clients import HONOR_KEY, Client, shard_clients
from nemo_gym_ext.config import (
    COMPACTION_ADAPTER,
    CONFIG_PATHS_KEY,
    TRUNCATION_KEY,
    GymActorConfig,
    compaction_agents,
)
from nemo_gym_ext.config_errors import ConfigIssue

ADAPTER_KEY = "env.gym.policy_adapter"


def text_only_history_survives_the_template(
    config: RecipeConfig, shards: list[GymActorConfig]
) -> list[ConfigIssue]:
    """A shard without truncation raises at its first non-contiguous episode. Where its clients
    certainly send text only (or the server ignores their ids) and the template probe shows the
    policy's template re-renders such a history differently, that is every multi-turn episode:
    refused here, naming the field that makes the history text only. The probe loads a
    tokenizer, so it runs only for a config it could refuse."""
    honor = config.generation.server.honor_prompt_token_ids
    exposed = _text_only_clients(config, shards, honor=honor)
    if not exposed:
        return []
    # Here, not at the top: the probe brings transformers (about a second to import), which
    # validating every other config (recipes/eval.py, recipes/serve.py, sweeps) does without.
    from gymrl.preflight.template_probe import probe_policy

    probe = probe_policy(config.policy, honor_prompt_token_ids=honor)
    broken = probe.text_only.divergence if probe.text_only is not None else None
    if broken is None:
        return []
    why = (
        f"{probe.template} is not append-only for a client that sends text only "
        f"({broken.describe()})"
    )
    if not honor:
        shard_keys = ", ".join(f"{shard.key_prefix}.{TRUNCATION_KEY}" for shard, _ in exposed)
        return [
            ConfigIssue(
                HONOR_KEY,
                False,
                f"{why}, and with {HONOR_KEY}=false every client's history is re-rendered, so "
                f"with {shard_keys}=false the run stops at its first multi-turn episode",
                _keep_ids_fix(HONOR_KEY),
            )
        ]
    issues = []
    for shard, clients in exposed:
        for client in clients:
            assert client.key is not None  # only a built-in agent is certainly text only
            issues.append(
                ConfigIssue(
                    client.key,
                    False,
                    f"{why}, so with {shard.key_prefix}.{TRUNCATION_KEY}=false the run stops at "
                    f"agent {client.name}'s first multi-turn episode",
                    _keep_ids_fix(client.key),
                )
            )
    return issues


def _text_only_clients(
    config: RecipeConfig, shards: list[GymActorConfig], *, honor: bool
) -> list[tuple[GymActorConfig, list[Client]]]:
    """The shards without truncation whose history reaches the server as text (clients that
    send text only, or every client when the server ignores their ids), with those clients."""
    exposed = [
        (shard, [c for c in shard_clients(config, shard) if c.text_only or not honor])
        for shard in shards
        if not shard.postprocess.truncate_noncontiguous_episodes
    ]
    return [(shard, clients) for shard, clients in exposed if clients]


def _keep_ids_fix(key: str) -> str:
    """The three ways out of a text-only history: keep the ids, truncate, or a better template."""
    return (
        f"set {key}=true (the server keeps the token ids clients send back), or "
        f"env.nemo_gym.{TRUNCATION_KEY}=true (train each episode's contiguous prefix), or use "
        "a template that writes earlier turns as they were generated (policy.chat_template)"
    )


def stop_on_divergence_needs_truncation(
    config: RecipeConfig, shards: list[GymActorConfig]
) -> list[ConfigIssue]:
    """Stopping a diverged episode keeps only the prefix truncation would train; a shard without
    truncation would instead stop the run at that episode, so nothing is left to save there."""
    if not config.generation.server.stop_on_divergence:
        return []
    return [
        ConfigIssue(
            f"{shard.key_prefix}.{TRUNCATION_KEY}",
            False,
            "generation.server.stop_on_divergence=true ends a diverged episode so that "
            "truncation trains its contiguous prefix; without truncation the first divergence "
            "stops the run",
            f"set {shard.key_prefix}.{TRUNCATION_KEY}=true, or "
            "generation.server.stop_on_divergence=false",
        )
        for shard in shards
        if not shard.postprocess.truncate_noncontiguous_episodes
    ]


def split_segments_weigh_the_episode_once(
    config: RecipeConfig, shards: list[GymActorConfig]
) -> list[ConfigIssue]:
    """A split episode is one episode (docs/configuration.md, "What the episode is"), but its
    tail segments are trained as sequences of their own: a loss that weighs or judges each
    sequence as a whole (a per-sequence mean, a sequence-level importance ratio) would count it
    once per segment, on a ratio of part of it. Refused until the loss sees episodes. The keys
    reported are the loss's (`loss.*`), the shard's split the other fix."""
    return [
        ConfigIssue(
            key,
            value,
            f"{shard.key_prefix}.split_noncontiguous_segments="
            f"{shard.postprocess.split_noncontiguous_segments} trains a split episode's tail "
            "segments as sequences of their own, so this would weigh (or judge) the episode once "
            "per segment",
            f"{fix}, or {shard.key_prefix}.split_noncontiguous_segments=0",
        )
        for shard in shards
        if shard.postprocess.split_noncontiguous_segments
        for key, (value, fix) in config.loss.whole_sequence_choices().items()
    ]


def compaction_agents_need_the_compaction_adapter(
    config: RecipeConfig, shards: list[GymActorConfig]
) -> list[ConfigIssue]:
    """A compaction agent (`context_history.enabled`) sends `required_prefix_token_ids` on every
    model call, which Gym's plain `vllm_model` adapter refuses (422): every one of its episodes
    would fail, each only after the deployment started. Refused unless the recipe injects the
    compaction twin. The agents are read from each shard's inline server blocks and from the
    Gym config files of its `config_paths` this machine holds, found as `ng_run` finds them
    (`env.gym.server_roots`, the working directory, Gym's site-packages; not the files those
    name in turn)."""
    adapter = config.env.gym.policy_adapter
    if config.env.source != "gym_launch" or adapter == COMPACTION_ADAPTER:
        return []
    return [
        ConfigIssue(
            ADAPTER_KEY,
            adapter,
            f"{where} runs the compaction agent {server!r} (context_history.enabled=true), which "
            f"sends required_prefix_token_ids on every model call; Gym's {adapter} adapter "
            "refuses that field, so every episode of that agent would fail",
            f"set {ADAPTER_KEY}={COMPACTION_ADAPTER} (it forwards the prefix, which the policy "
            "server honours), or turn the agent's context_history off",
        )
        for shard in shards
        for where, server in _compaction_agents_of(config, shard)
    ]


def _compaction_agents_of(config: RecipeConfig, shard: GymActorConfig) -> Iterator[tuple[str, str]]:
    """(where the agent is declared, its server) for each compaction agent of `shard`."""
    for name, server in compaction_agents(shard.gym_config).items():
        yield f"{shard.key_prefix}.{name}", server
    for entry in shard.gym_config.get(CONFIG_PATHS_KEY) or []:
        found = _gym_config_file(config, str(entry))
        if found is None:
            continue  # ng_run names a config file it cannot find
        with found.open() as stream:
            declared = yaml.safe_load(stream)
        if isinstance(declared, dict):
            for name, server in compaction_agents(declared).items():
                yield f"{name} (in {CONFIG_PATHS_KEY} entry {entry})", server


def _gym_config_file(config: RecipeConfig, entry: str) -> Path | None:
    """Where `ng_run` would read a `config_paths` entry from, or None where this machine has
    none: as is when absolute, else under the first of the server roots, the working directory
    and Gym's site-packages that holds it (nemo_gym.component_search_roots)."""
    if Path(entry).is_absolute():
        return Path(entry) if Path(entry).is_file() else None
    roots = [
        *(Path(root) for root in config.env.gym.server_roots),
        Path.cwd(),
        *sorted(Path(config.env.gym.venv).glob("lib/python*/site-packages")),
    ]
    return next((root / entry for root in roots if (root / entry).is_file()), None)


def server_roots_exist(config: RecipeConfig) -> list[ConfigIssue]:
    """A server root that is not a folder would only show when `ng_run` fails to find the
    server it should hold, after the policy and the deployment's other servers started."""
    if config.env.source != "gym_launch":
        return []
    return [
        ConfigIssue(
            f"env.gym.server_roots[{index}]",
            root,
            "not a folder on this machine, so Gym would not find the servers it should hold",
            "give a folder laid out as Gym's (<root>/<kind>/<server>/app.py), e.g. "
            "${repo_path:gym_servers}, or remove the entry",
        )
        for index, root in enumerate(config.env.gym.server_roots)
        if not Path(root).is_dir()
    ]

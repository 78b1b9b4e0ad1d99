"""build_gym_actor_config: shard merging, recipe-only keys, and the truncation guard matrix."""

import copy
import functools
import itertools

import pytest

from nemo_gym_ext.config import (
    RECIPE_ONLY_KEYS,
    AgentSpec,
    NemoGymPostprocessConfig,
    build_all_gym_actor_configs,
    build_gym_actor_config,
    deep_merge,
    shard_names,
)
from nemo_gym_ext.config_errors import ConfigError
from nemo_gym_ext.envs.agent import AgentOptions

AGENTS = {"calc": {"environment": "calculator", "options": {"max_turns": 3}}}


def test_defaults_live_in_the_postprocess_model():
    assert NemoGymPostprocessConfig().truncate_noncontiguous_episodes is False
    assert NemoGymPostprocessConfig().on_malformed_result == "raise"


@pytest.mark.parametrize("value", [None, False, True])
def test_absent_false_true_resolution(value):
    nemo_gym = {"agents": AGENTS}
    if value is not None:
        nemo_gym["truncate_noncontiguous_episodes"] = value
    actor = build_gym_actor_config(
        nemo_gym, source="builtin", router_replay_enabled=False, token_capture_enabled=False
    )
    assert actor.shard == "default"
    assert actor.postprocess.truncate_noncontiguous_episodes is bool(value)
    assert actor.gym_config == {"agents": AGENTS}


def _nemo_gym(truncate_where, gym_capture_where):
    """A two-shard config with truncation / Gym's token-id capture set in the base, one shard,
    or nowhere."""
    nemo_gym = {
        "shards": {
            "a": {"config_paths": ["a.yaml"]},
            "b": {"config_paths": ["b.yaml"]},
        }
    }
    for key, where, value in (
        ("truncate_noncontiguous_episodes", truncate_where, True),
        ("token_id_capture", gym_capture_where, {"enabled": True, "all_agents": True}),
    ):
        if where == "base":
            nemo_gym[key] = value
        elif where == "shard_b":
            nemo_gym["shards"]["b"][key] = value
    return nemo_gym


PLACES = [None, "base", "shard_b"]
# Each capture switch: none, NeMo-RL's top-level receipt mode, Gym's capture in the base or in
# shard b only.
CAPTURE_SWITCHES = [None, "token_capture", "gym_base", "gym_shard_b"]


@pytest.mark.parametrize(
    ("truncate_where", "capture", "router_replay"),
    list(itertools.product(PLACES, CAPTURE_SWITCHES, [False, True])),
)
def test_truncation_guard_matrix(truncate_where, capture, router_replay):
    gym_capture_where = {"gym_base": "base", "gym_shard_b": "shard_b"}.get(capture)
    nemo_gym = _nemo_gym(truncate_where, gym_capture_where)
    before = copy.deepcopy(nemo_gym)

    truncating = {"a": truncate_where == "base", "b": truncate_where is not None}
    gym_capture = {"a": gym_capture_where == "base", "b": gym_capture_where is not None}
    expected_conflicts = {
        (shard, kind)
        for shard in "ab"
        if truncating[shard]
        for kind, on in (
            ("router", router_replay),
            ("token_capture", capture == "token_capture"),
            ("gym_capture", gym_capture[shard]),
        )
        if on
    }
    build = functools.partial(
        build_all_gym_actor_configs,
        nemo_gym,
        source="gym_launch",
        router_replay_enabled=router_replay,
        token_capture_enabled=capture == "token_capture",
    )
    if not expected_conflicts:
        assert {
            actor.shard: actor.postprocess.truncate_noncontiguous_episodes for actor in build()
        } == truncating
    else:
        with pytest.raises(ConfigError) as raised:
            build()
        keys = {
            "policy.router_replay.enabled": "router",
            "token_capture.enabled": "token_capture",
        }
        found = set()
        for issue in raised.value.issues:
            shard = "a" if "shard 'a'" in issue.problem else "b"
            kind = keys.get(issue.key, "gym_capture")
            found.add((shard, kind))
            # the message names the shard and both keys
            assert "truncate_noncontiguous_episodes" in issue.problem
            assert f"shard {shard}" in issue.problem
            if kind == "gym_capture":
                assert issue.key == f"env.nemo_gym[shard {shard}].token_id_capture.enabled"
                assert issue.fix.startswith(f"set {issue.key}=false")
        assert found == expected_conflicts
    assert nemo_gym == before, "the caller's config must not be mutated"


def test_gym_capture_switched_off_in_a_shard_does_not_conflict():
    nemo_gym = _nemo_gym("base", "base")
    nemo_gym["shards"]["a"]["token_id_capture"] = {"enabled": False}
    with pytest.raises(ConfigError) as raised:
        build_all_gym_actor_configs(
            nemo_gym, source="gym_launch", router_replay_enabled=False, token_capture_enabled=False
        )
    assert [issue.key for issue in raised.value.issues] == [
        "env.nemo_gym[shard b].token_id_capture.enabled"
    ]


def test_no_recipe_only_key_reaches_any_shard_gym_config():
    nemo_gym = {
        "truncate_noncontiguous_episodes": True,
        "on_malformed_result": "mask",
        "token_id_capture": {"dir": "/tmp/capture"},
        "shards": {
            "a": {"config_paths": ["a.yaml"], "truncate_noncontiguous_episodes": False},
            "b": {"config_paths": ["b.yaml"], "token_id_capture": {"delta_records": True}},
        },
    }
    before = copy.deepcopy(nemo_gym)
    actors = build_all_gym_actor_configs(
        nemo_gym, source="gym_launch", router_replay_enabled=False, token_capture_enabled=False
    )
    for actor in actors:
        assert not RECIPE_ONLY_KEYS & set(actor.gym_config)
        assert "shards" not in actor.gym_config
    by_shard = {actor.shard: actor for actor in actors}
    assert by_shard["a"].postprocess.truncate_noncontiguous_episodes is False
    assert by_shard["b"].postprocess.truncate_noncontiguous_episodes is True
    assert by_shard["b"].postprocess.on_malformed_result == "mask"
    # shard overrides merge recursively over the base
    capture = {"dir": "/tmp/capture", "delta_records": True}
    assert by_shard["b"].gym_config["token_id_capture"] == capture
    assert by_shard["a"].gym_config["token_id_capture"] == {"dir": "/tmp/capture"}
    # the returned configs are independent copies
    by_shard["a"].gym_config["token_id_capture"]["dir"] = "elsewhere"
    assert nemo_gym == before


def test_misspelled_recipe_only_key_is_named_not_forwarded():
    with pytest.raises(ConfigError) as raised:
        build_gym_actor_config(
            {"truncate_noncontigous_episodes": True, "agents": AGENTS},
            source="builtin",
            router_replay_enabled=False,
            token_capture_enabled=False,
        )
    (issue,) = raised.value.issues
    assert issue.key == "env.nemo_gym.truncate_noncontigous_episodes"
    assert "truncate_noncontiguous_episodes" in issue.fix


def test_wrong_type_of_recipe_only_key_names_key_value_and_fix():
    with pytest.raises(ConfigError) as raised:
        build_gym_actor_config(
            {"truncate_noncontiguous_episodes": "sometimes", "agents": AGENTS},
            source="builtin",
            router_replay_enabled=False,
            token_capture_enabled=False,
        )
    (issue,) = raised.value.issues
    assert issue.key == "env.nemo_gym.truncate_noncontiguous_episodes"
    assert issue.value == "sometimes"
    assert issue.fix == "set true or false"
    assert "sometimes" in str(raised.value)


def test_shard_names_and_unknown_shard():
    assert shard_names({"agents": AGENTS}) == ["default"]
    assert shard_names({"shards": {"x": {}, "y": None}}) == ["x", "y"]
    with pytest.raises(KeyError, match="no shard 'z'"):
        build_gym_actor_config(
            {"shards": {"x": {}}},
            "z",
            source="builtin",
            router_replay_enabled=False,
            token_capture_enabled=False,
        )


def test_nested_shards_are_refused():
    nemo_gym = {"shards": {"x": {"shards": {"y": {}}}}}
    with pytest.raises(ConfigError, match="cannot be nested"):
        build_gym_actor_config(
            nemo_gym,
            "x",
            source="builtin",
            router_replay_enabled=False,
            token_capture_enabled=False,
        )


def test_deep_merge_returns_new_containers():
    base = {"a": {"b": [1, 2], "c": 1}}
    merged = deep_merge(base, {"a": {"c": 2}})
    merged["a"]["b"].append(3)
    assert base == {"a": {"b": [1, 2], "c": 1}}
    assert merged == {"a": {"b": [1, 2, 3], "c": 2}}


def _agent_issues(agents):
    with pytest.raises(ConfigError) as raised:
        build_gym_actor_config(
            {"agents": agents},
            source="builtin",
            router_replay_enabled=False,
            token_capture_enabled=False,
        )
    return {issue.key: issue for issue in raised.value.issues}


def test_agents_are_read_once_as_typed_specs():
    actor = build_gym_actor_config(
        {"agents": {**AGENTS, "swe": {"url": "http://gym-head:8000/swe/"}}},
        source="builtin",
        router_replay_enabled=False,
        token_capture_enabled=False,
    )
    assert actor.agents == {
        "calc": AgentSpec(environment="calculator", options=AgentOptions(max_turns=3)),
        "swe": AgentSpec(url="http://gym-head:8000/swe"),
    }
    assert [spec.describe() for spec in actor.agents.values()] == [
        "calculator",
        "http://gym-head:8000/swe",
    ]
    assert actor.gym_config["agents"]["swe"] == {"url": "http://gym-head:8000/swe/"}


def test_a_builtin_agent_calls_the_recipe_policy_unless_its_options_name_one():
    (spec,) = build_gym_actor_config(
        {"agents": AGENTS},
        source="builtin",
        router_replay_enabled=False,
        token_capture_enabled=False,
    ).agents.values()
    options = spec.agent_options(policy_model="smollm2")
    assert (options.policy_model, options.max_turns) == ("smollm2", 3)
    assert options.send_token_ids is AgentOptions().send_token_ids
    named = AgentSpec(environment="calculator", options={"policy_model": "mine"})
    assert named.agent_options(policy_model="smollm2").policy_model == "mine"
    assert AgentSpec(environment="calculator").agent_options(policy_model="p") == AgentOptions(
        policy_model="p"
    )


@pytest.mark.parametrize(
    ("spec", "key", "problem", "fix"),
    [
        ({}, "", "exactly one of `environment` (built-in) or `url`", "set environment: <built-in>"),
        (
            {"environment": "calculator", "url": "http://a"},
            "",
            "exactly one of",
            "or url: http://host:port",
        ),
        (
            {"url": "http://a", "options": {"max_turns": 2}},
            "",
            "a remote agent has its own",
            "remove options",
        ),
        ({"url": "gym-head:8000"}, ".url", "not an http(s) URL", "write url: http://"),
        ({"url": "http://a", "urll": 1}, ".urll", "unknown key", "did you mean 'url'?"),
        ({"environment": "guess_numbr"}, ".environment", "no built-in", "did you mean 'guess_"),
        (
            {"environment": "calculator", "options": {"send_token_ids": "often"}},
            ".options.send_token_ids",
            "valid boolean",
            "set true or false",
        ),
        (None, "", "valid dictionary", "set environment: <built-in>"),
    ],
    ids=[
        "neither",
        "both",
        "remote-with-options",
        "url-without-scheme",
        "remote-typo",
        "environment-typo",
        "option-type",
        "null-spec",
    ],
)
def test_an_invalid_agent_spec_is_one_issue_with_key_and_fix(spec, key, problem, fix):
    issues = _agent_issues({**AGENTS, "bad": spec})
    (issue,) = issues.values()
    assert issue.key == f"env.nemo_gym.agents.bad{key}"
    assert problem in issue.problem
    assert fix in issue.fix


@pytest.mark.parametrize("agents", [None, {}, ["calc"]])
def test_a_shard_without_agents_is_refused(agents):
    issues = _agent_issues(agents)
    assert issues["env.nemo_gym.agents"].problem == "a shard must serve at least one agent"


def test_an_agent_served_by_two_shards_is_refused():
    nemo_gym = {
        "shards": {
            "a": {"agents": {"x": {"url": "http://a"}}},
            "b": {"agents": {"x": {"url": "http://b"}, "y": {"url": "http://c"}}},
        }
    }
    with pytest.raises(ConfigError) as raised:
        build_all_gym_actor_configs(
            nemo_gym, source="builtin", router_replay_enabled=False, token_capture_enabled=False
        )
    (issue,) = raised.value.issues
    assert issue.key == "env.nemo_gym[shard b].agents.x"
    assert issue.problem == "agent 'x' is served by shards 'a' and 'b'"


def _source_issues(nemo_gym, source):
    with pytest.raises(ConfigError) as raised:
        build_gym_actor_config(
            nemo_gym, source=source, router_replay_enabled=False, token_capture_enabled=False
        )
    return {issue.key: issue for issue in raised.value.issues}


SERVER_BLOCK = {"responses_api_agents": {"simple_agent": {"entrypoint": "app.py"}}}


def test_each_source_refuses_the_keys_it_does_not_read():
    issues = _source_issues({"agents": AGENTS, "config_paths": ["x.yaml"]}, "builtin")
    assert issues["env.nemo_gym.config_paths"].fix == "select env=gym_launch for it, or remove it"
    issues = _source_issues({"head_server_url": "http://h:1", "agents": AGENTS}, "gym_join")
    assert issues["env.nemo_gym.agents"].fix == "select env=builtin for it, or remove it"
    issues = _source_issues({"config_paths": ["x.yaml"], "head_server": {"port": 1}}, "gym_launch")
    assert "the recipe sets this Gym key itself" in issues["env.nemo_gym.head_server"].problem
    issues = _source_issues({"config_paths": ["x.yaml"], "skip_verifcation": 1}, "gym_launch")
    assert issues["env.nemo_gym.skip_verifcation"].fix.startswith(
        "did you mean 'skip_verification'?"
    )
    # a mapping that is not shaped like a server block is not one
    issues = _source_issues({"my_agent": {"simple_agent": {"entrypoint": "app.py"}}}, "gym_launch")
    assert set(issues) == {"env.nemo_gym.my_agent", "env.nemo_gym.config_paths"}


def test_launch_takes_config_paths_or_inline_server_blocks_and_join_needs_its_url():
    for nemo_gym in ({"config_paths": ["x.yaml"]}, {"my_agent": SERVER_BLOCK}):
        actor = build_gym_actor_config(
            nemo_gym, source="gym_launch", router_replay_enabled=False, token_capture_enabled=False
        )
        assert actor.gym_config == nemo_gym and actor.agents == {}
    assert set(_source_issues({}, "gym_join")) == {"env.nemo_gym.head_server_url"}

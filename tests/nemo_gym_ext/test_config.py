"""build_gym_actor_config: shard merging, recipe-only keys, and the truncation guard matrix."""

import copy
import itertools

import pytest

from nemo_gym_ext.config import (
    RECIPE_ONLY_KEYS,
    AgentSpec,
    ConfigError,
    NemoGymPostprocessConfig,
    build_all_gym_actor_configs,
    build_gym_actor_config,
    deep_merge,
    shard_names,
)
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
    actor = build_gym_actor_config(nemo_gym, router_replay_enabled=False)
    assert actor.shard == "default"
    assert actor.postprocess.truncate_noncontiguous_episodes is bool(value)
    assert actor.gym_config == {"agents": AGENTS}


def _nemo_gym(truncate_where, receipt_where):
    """A two-shard config with truncation / receipt mode set in the base, one shard, or nowhere."""
    nemo_gym = {
        "shards": {
            "a": {"agents": {"a1": {"url": "http://a"}}},
            "b": {"agents": {"b1": {"url": "http://b"}}},
        }
    }
    for key, where, value in (
        ("truncate_noncontiguous_episodes", truncate_where, True),
        ("token_capture", receipt_where, {"receipt_mode": True}),
    ):
        if where == "base":
            nemo_gym[key] = value
        elif where == "shard_b":
            nemo_gym["shards"]["b"][key] = value
    return nemo_gym


PLACES = [None, "base", "shard_b"]


@pytest.mark.parametrize(
    ("truncate_where", "receipt_where", "router_replay"),
    list(itertools.product(PLACES, PLACES, [False, True])),
)
def test_truncation_guard_matrix(truncate_where, receipt_where, router_replay):
    nemo_gym = _nemo_gym(truncate_where, receipt_where)
    before = copy.deepcopy(nemo_gym)

    truncating = {"a": truncate_where == "base", "b": truncate_where is not None}
    receipt = {"a": receipt_where == "base", "b": receipt_where is not None}
    expected_conflicts = {
        (shard, kind)
        for shard in "ab"
        if truncating[shard]
        for kind, on in (("router", router_replay), ("receipt", receipt[shard]))
        if on
    }
    if not expected_conflicts:
        actors = build_all_gym_actor_configs(nemo_gym, router_replay_enabled=router_replay)
        assert {
            actor.shard: actor.postprocess.truncate_noncontiguous_episodes for actor in actors
        } == truncating
    else:
        with pytest.raises(ConfigError) as raised:
            build_all_gym_actor_configs(nemo_gym, router_replay_enabled=router_replay)
        found = set()
        for issue in raised.value.issues:
            shard = "a" if "shard 'a'" in issue.problem else "b"
            kind = "router" if issue.key == "policy.router_replay.enabled" else "receipt"
            found.add((shard, kind))
            # the message names the shard and both keys
            assert "truncate_noncontiguous_episodes" in issue.problem
            assert f"shard {shard}" in issue.problem
            if kind == "receipt":
                assert issue.key == f"env.nemo_gym[shard {shard}].token_capture.receipt_mode"
        assert found == expected_conflicts
    assert nemo_gym == before, "the caller's config must not be mutated"


def test_no_recipe_only_key_reaches_any_shard_gym_config():
    nemo_gym = {
        "truncate_noncontiguous_episodes": True,
        "on_malformed_result": "mask",
        "head_server": {"port": 11000},
        "shards": {
            "a": {"agents": {"a1": {"url": "http://a"}}, "truncate_noncontiguous_episodes": False},
            "b": {"agents": {"b1": {"url": "http://b"}}, "head_server": {"host": "h"}},
        },
    }
    before = copy.deepcopy(nemo_gym)
    actors = build_all_gym_actor_configs(nemo_gym, router_replay_enabled=False)
    for actor in actors:
        assert not RECIPE_ONLY_KEYS & set(actor.gym_config)
        assert "shards" not in actor.gym_config
    by_shard = {actor.shard: actor for actor in actors}
    assert by_shard["a"].postprocess.truncate_noncontiguous_episodes is False
    assert by_shard["b"].postprocess.truncate_noncontiguous_episodes is True
    assert by_shard["b"].postprocess.on_malformed_result == "mask"
    # shard overrides merge recursively over the base
    assert by_shard["b"].gym_config["head_server"] == {"port": 11000, "host": "h"}
    assert by_shard["a"].gym_config["head_server"] == {"port": 11000}
    # the returned configs are independent copies
    by_shard["a"].gym_config["head_server"]["port"] = 1
    assert nemo_gym == before


def test_misspelled_recipe_only_key_is_named_not_forwarded():
    with pytest.raises(ConfigError) as raised:
        build_gym_actor_config(
            {"truncate_noncontigous_episodes": True, "agents": AGENTS}, router_replay_enabled=False
        )
    (issue,) = raised.value.issues
    assert issue.key == "env.nemo_gym.truncate_noncontigous_episodes"
    assert "truncate_noncontiguous_episodes" in issue.fix


def test_wrong_type_of_recipe_only_key_names_key_value_and_fix():
    with pytest.raises(ConfigError) as raised:
        build_gym_actor_config(
            {"truncate_noncontiguous_episodes": "sometimes", "agents": AGENTS},
            router_replay_enabled=False,
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
        build_gym_actor_config({"shards": {"x": {}}}, "z", router_replay_enabled=False)


def test_nested_shards_are_refused():
    nemo_gym = {"shards": {"x": {"shards": {"y": {}}}}}
    with pytest.raises(ConfigError, match="cannot be nested"):
        build_gym_actor_config(nemo_gym, "x", router_replay_enabled=False)


def test_deep_merge_returns_new_containers():
    base = {"a": {"b": [1, 2], "c": 1}}
    merged = deep_merge(base, {"a": {"c": 2}})
    merged["a"]["b"].append(3)
    assert base == {"a": {"b": [1, 2], "c": 1}}
    assert merged == {"a": {"b": [1, 2, 3], "c": 2}}


def _agent_issues(agents):
    with pytest.raises(ConfigError) as raised:
        build_gym_actor_config({"agents": agents}, router_replay_enabled=False)
    return {issue.key: issue for issue in raised.value.issues}


def test_agents_are_read_once_as_typed_specs():
    actor = build_gym_actor_config(
        {"agents": {**AGENTS, "swe": {"url": "http://gym-head:8000/swe/"}}},
        router_replay_enabled=False,
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
        {"agents": AGENTS}, router_replay_enabled=False
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
        build_all_gym_actor_configs(nemo_gym, router_replay_enabled=False)
    (issue,) = raised.value.issues
    assert issue.key == "env.nemo_gym[shard b].agents.x"
    assert issue.problem == "agent 'x' is served by shards 'a' and 'b'"

"""The schema is the one source of defaults: conf/ restates none of them, and every key it
defaults reaches the Hydra composition, so a plain override (no `+`) works for each of them."""

import json
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gymrl.config.compose import (
    BACKEND_UNIONS,
    CONFIG_DIR,
    backend_classes,
    compose_raw,
    recipe_defaults,
    schema_defaults,
)
from gymrl.preflight.validate import validate_config

ABSENT = object()
GLOBAL_PACKAGE = "# @package _global_"
YAML_FILES = sorted(path.relative_to(CONFIG_DIR) for path in CONFIG_DIR.rglob("*.yaml"))
EFFECTIVE_VALUES = Path(__file__).with_name("effective_values.json")
SHIPPED_RUNS = {
    "default": [],
    **{
        name: [f"+experiment={name}"]
        for name in [
            "smoke",
            "smoke_noncontiguous",
            "swe_bench_30b",
            "math_1p5b",
            "truncation_ablation",
        ]
    },
}


def _leaves(tree, prefix=""):
    """Dotted path -> value of every leaf; lists and empty mappings are leaves."""
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _at(tree, dotted):
    """The value at a dotted path, or ABSENT."""
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return ABSENT
        tree = tree[part]
    return tree


def _how_composition_selects(relative: Path, text: str) -> tuple[list[str], str]:
    """The overrides that pull `relative` into the composition, and the package it lands in."""
    if relative == Path("grpo.yaml"):
        return [], ""
    group, option = relative.parent.as_posix(), relative.stem
    if group == "experiment":
        return [f"+experiment={option}"], ""
    if GLOBAL_PACKAGE in text:  # a group file that also sets keys outside its group
        return [f"{group}={option}"], ""
    return [f"{group}={option}"], f"{group.replace('/', '.')}."


def _restated(conf: Path, relative: Path, scratch: Path) -> dict:
    """The values conf/`relative` sets that the composition holds without them, by composing once
    as is and once from a copy where the file keeps only its defaults list (and hydra keys)."""
    text = (conf / relative).read_text()
    overrides, package = _how_composition_selects(relative, text)
    body = OmegaConf.to_container(OmegaConf.create(text))
    kept = {key: body.pop(key) for key in ("defaults", "hydra") if key in body}
    without = scratch / "conf"
    shutil.copytree(conf, without)
    header = f"{GLOBAL_PACKAGE}\n" if GLOBAL_PACKAGE in text else ""
    (without / relative).write_text(header + (OmegaConf.to_yaml(kept) if kept else ""))
    seen = compose_raw(overrides, config_dir=conf)
    anyway = compose_raw(overrides, config_dir=without)
    paths = [f"{package}{path}" for path, _ in _leaves(body)]
    return {path: _at(seen, path) for path in paths if _at(seen, path) == _at(anyway, path)}


@pytest.mark.parametrize("relative", YAML_FILES, ids=str)
def test_no_yaml_value_restates_what_composition_gives_anyway(relative, tmp_path):
    restated = _restated(CONFIG_DIR, relative, tmp_path)
    assert not restated, (
        f"conf/{relative} sets values the composition holds without them (schema defaults in "
        f"gymrl/config/schema/, or what the experiment builds on): remove {restated}"
    )


def test_the_restatement_check_sees_restated_defaults(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONFIG_DIR, conf)
    (conf / "loss" / "grpo.yaml").write_text("kl_coef: 0.0\nclip_ratio_high: 0.3\n")
    (conf / "experiment" / "big.yaml").write_text(
        f"{GLOBAL_PACKAGE}\ndefaults:\n  - override /trainer: megatron\n"
        "trainer:\n  optimizer:\n    lr: 1.0e-6\n    weight_decay: 0.1\n"
    )
    assert _restated(conf, Path("loss/grpo.yaml"), tmp_path / "a") == {"loss.kl_coef": 0.0}
    assert _restated(conf, Path("experiment/big.yaml"), tmp_path / "b") == {
        "trainer.optimizer.lr": 1e-6
    }


@pytest.mark.parametrize("trainer", sorted(backend_classes(BACKEND_UNIONS["trainer"])))
@pytest.mark.parametrize("generation", sorted(backend_classes(BACKEND_UNIONS["generation"])))
def test_every_schema_default_is_in_the_composed_tree(generation, trainer):
    """What makes `--cfg job` complete and a plain override of any schema key legal."""
    composed = compose_raw([f"generation={generation}", f"trainer={trainer}"])
    expected = [path for path, _ in _leaves(recipe_defaults())]
    for group, backend in (("generation", generation), ("trainer", trainer)):
        model = backend_classes(BACKEND_UNIONS[group])[backend]
        expected += [f"{group}.{path}" for path, _ in _leaves(schema_defaults(model))]
    assert [path for path in expected if _at(composed, path) is ABSENT] == []


COMMON_OVERRIDES = {
    "trainer.optimizer.lr": 3e-6,
    "trainer.optimizer.betas": [0.8, 0.95],
    "generation.server.api_key_file": "/run/secrets/policy_key",
    "generation.sampling.top_p": 0.9,
    "policy.model_cache_dir": "/tmp/models",
    "loss.off_policy_correction.mode": "token_mask",
    "env.rollout.max_retries": 0,
    "env.nemo_gym.truncate_noncontiguous_episodes": True,
    "cluster.ray_start_timeout_s": 5.0,
    "logger.wandb.entity": "team",
    "grpo.batch_timeout_s": 60.0,
    "run.seed": 7,
}


@pytest.mark.parametrize(
    ("setup", "backend_overrides"),
    [
        ([], {"generation.max_batch_size": 3, "trainer.micro_batch_size": 3}),
        (
            [
                "generation=sglang",
                "cluster=slurm_8gpu",
                "generation.server.max_tokens_per_turn=512",
            ],
            {"generation.server_start_timeout_s": 60.0, "trainer.optimizer.eps": 1e-6},
        ),
        (
            ["+experiment=math_1p5b"],
            {"generation.max_running_requests": 32, "trainer.activation_checkpointing": False},
        ),
    ],
    ids=["torch+torch", "sglang+torch", "sglang+megatron"],
)
def test_deep_keys_override_without_plus(setup, backend_overrides):
    values = COMMON_OVERRIDES | backend_overrides
    overrides = [f"{key}={json.dumps(value)}" for key, value in values.items()]
    config = validate_config(compose_raw([*setup, *overrides])).model_dump(mode="json")
    assert {key: _at(config, key) for key in values} == values


def _effective_values() -> dict[str, dict]:
    return {
        run: validate_config(compose_raw(overrides)).model_dump(mode="json")
        for run, overrides in SHIPPED_RUNS.items()
    }


def test_shipped_runs_keep_their_effective_values():
    """Moving a default between the schema and conf/ must not change what a shipped run does.
    After an intended change, refresh: `PYTHONPATH=. python tests/gymrl/config/test_defaults.py`."""
    expected = json.loads(EFFECTIVE_VALUES.read_text())
    for run, config in _effective_values().items():
        got, want = dict(_leaves(config)), dict(_leaves(expected[run]))
        assert {
            k: (got.get(k), want.get(k))
            for k in got.keys() | want.keys()
            if got.get(k) != want.get(k)
        } == {}, run


if __name__ == "__main__":
    EFFECTIVE_VALUES.write_text(json.dumps(_effective_values(), indent=1, sort_keys=True) + "\n")

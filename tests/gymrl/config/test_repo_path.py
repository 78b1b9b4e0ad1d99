"""`${repo_path:...}`: a path inside this checkout, made absolute at composition, the same from any
working directory (Hydra keeps the caller's; Ray workers and child processes start elsewhere)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gymrl.config.compose import REPO_ROOT, compose_raw, register_resolvers, repo_path

ROOT = Path(__file__).resolve().parents[3]


def test_the_repository_root_is_the_checkout_holding_conf():
    assert REPO_ROOT == ROOT and (REPO_ROOT / "conf" / "grpo.yaml").is_file()


def test_a_relative_path_is_made_absolute_inside_the_checkout():
    assert repo_path("cpu_standins/sglang_server") == str(ROOT / "cpu_standins" / "sglang_server")


def test_an_absolute_path_is_refused_naming_the_root():
    with pytest.raises(ValueError, match="must be relative to the repository root"):
        repo_path("/opt/shims")


def test_the_cpu_configs_resolve_the_same_from_any_working_directory(tmp_path):
    """The dry run's plan, from a directory that is not the checkout."""
    command = [sys.executable, str(ROOT / "recipes" / "grpo.py"), "+experiment=flagship_cpu"]
    done = subprocess.run(
        [*command, "dry_run=true", f"hydra.run.dir={tmp_path}"],
        cwd=tmp_path,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert f"PYTHONPATH {ROOT / 'cpu_standins' / 'sglang_server'}" in done.stdout
    assert f"python {ROOT / '.venv-megatron' / 'bin' / 'python'}, " in done.stdout
    assert f"{ROOT / 'data' / 'gym_example' / 'train.jsonl'}: 8 rows" in done.stdout


def test_a_tree_composed_here_resolves_in_a_process_that_registered_nothing_yet():
    """A sweep point on Slurm resolves the tree its launcher composed: `to_plain_dict`
    registers the resolver itself (here: idempotent registration, then plain values)."""
    register_resolvers()
    register_resolvers()
    tree = OmegaConf.create({"x": "${repo_path:data}"})
    assert OmegaConf.to_container(tree, resolve=True) == {"x": str(ROOT / "data")}
    raw = compose_raw(["generation=sglang_cpu"])
    assert raw["generation"]["launch"]["python"] == str(ROOT / ".venv-sglang" / "bin" / "python")

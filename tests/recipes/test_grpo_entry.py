"""The entry point as a user runs it: `python recipes/grpo.py ...` in a subprocess."""

import subprocess
import sys
from pathlib import Path

import pytest

from nemo_gym_ext.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def run_recipe(*overrides, tmp_path, check_modules=False):
    """Run the recipe; with check_modules, also report whether torch, Ray or matplotlib got
    imported."""
    args = [*overrides, f"hydra.run.dir={tmp_path}"]
    if check_modules:
        code = (
            "import runpy, sys\n"
            f"sys.argv = ['recipes/grpo.py', *{args!r}]\n"
            "try:\n    runpy.run_path('recipes/grpo.py', run_name='__main__')\n"
            "finally:\n"
            "    print('HEAVY', sorted({'torch', 'ray', 'matplotlib'} & set(sys.modules)))\n"
        )
        command = [sys.executable, "-c", code]
    else:
        command = [sys.executable, "recipes/grpo.py", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("experiment", ["swe_bench_30b", "math_1p5b", "flagship_cpu"])
def test_dry_run_prints_the_plan_and_starts_nothing(experiment, tmp_path):
    done = run_recipe(
        f"+experiment={experiment}", "dry_run=true", tmp_path=tmp_path, check_modules=True
    )
    assert done.returncode == 0, done.stderr
    assert "dry run: config valid, nothing started" in done.stdout
    assert "truncate_noncontiguous_episodes=true" in done.stdout
    assert "GPUs" in done.stdout and "gym shards" in done.stdout
    assert "HEAVY []" in done.stdout, "a dry run must not import torch, Ray or matplotlib"


def test_a_run_whose_venv_was_not_made_stops_before_it_starts_naming_the_make_target(tmp_path):
    """The CPU experiments' interpreters lie in this checkout's venvs; one that `make` has not
    made stops the run with exit 2 before Ray starts (here a name no venv holds)."""
    python = ROOT / ".venv-sglang" / "bin" / "no-such-python"
    done = run_recipe(
        "+experiment=sglang_cpu_smoke",
        f"generation.launch.python={python}",
        f"run.output_dir={tmp_path}",
        tmp_path=tmp_path,
        check_modules=True,
    )
    assert done.returncode == 2, done.stderr
    assert "run not started: environments missing on this machine" in done.stderr
    assert f"generation.launch.python = '{python}'" in done.stderr
    assert "make it with `make sglang-venv`" in done.stderr
    assert "HEAVY []" in done.stdout, "refused before torch or Ray"


def test_swe_plan_names_gpus_per_role_and_shards(tmp_path):
    done = run_recipe("+experiment=swe_bench_30b", "dry_run=true", tmp_path=tmp_path)
    out = done.stdout
    assert "Qwen3-30B-A3B" in out
    assert "16 engine(s) x TP 4 (EP 4) = 64 GPUs" in out
    assert "megatron: 64 GPUs, TP 4 x PP 1 x CP 2 -> DP 8, EP 8" in out
    assert "start-up deadline 1800 s" in out  # the Megatron default, sized for this load
    assert "openhands: truncate_noncontiguous_episodes=true" in out
    assert "mini_swe: truncate_noncontiguous_episodes=true" in out


def test_router_replay_with_truncation_is_refused_with_a_clear_message(tmp_path):
    done = run_recipe(
        "+experiment=swe_bench_30b",
        "policy.router_replay.enabled=true",
        "dry_run=true",
        tmp_path=tmp_path,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "policy.router_replay.enabled = True" in done.stderr
    assert "truncate_noncontiguous_episodes=true (shard 'openhands')" in done.stderr
    assert "fix: set policy.router_replay.enabled=false" in done.stderr


def test_an_unreachable_ray_cluster_is_one_clear_message(tmp_path):
    """An address where nothing listens (not `auto`, which would join any Ray cluster running
    on this machine): refused within cluster.ray_start_timeout_s, in one line."""
    address = f"127.0.0.1:{free_port()}"
    done = run_recipe(
        "+experiment=math_1p5b",
        f"cluster.ray_address={address}",
        "cluster.ray_start_timeout_s=3",
        tmp_path=tmp_path,
    )
    assert done.returncode == 1
    assert f"run stopped: ClusterUnavailableError: cluster.ray_address='{address}'" in done.stderr
    assert "launch/ray.sub" in done.stderr and "Traceback" not in done.stderr

"""`recipes/eval.py` on a checkpoint of `+experiment=smoke`, through the real entry points: on
both built-in agents an eval of step 2 with validation's sampling gives that step's validation
figures key for key; the same checkpoint on a launched NeMo-Gym deployment (Gym's own example
environments, from `.venv-gym`); Ctrl-C keeps what finished and exits 130. Minutes on two cores:
`slow`."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.recipes.recipe_runs import read_metrics, run_recipe

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
GYM_AGENTS = ("example_multi_step_simple_agent", "example_single_tool_call_simple_agent")


def eval_command(run: Path, out: Path, *overrides: str) -> list[str]:
    return [
        sys.executable,
        "recipes/eval.py",
        f"eval.checkpoint={run}",
        f"eval.output_dir={out}",
        f"run.output_dir={run}",
        f"hydra.run.dir={run}",
        *overrides,
    ]


def run_eval(run: Path, out: Path, *overrides: str, timeout: int = 900):
    return subprocess.run(
        eval_command(run, out, *overrides),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """3 steps of the tiny model, validated after step 2 and 3, a checkpoint of step 2."""
    out = tmp_path_factory.mktemp("smoke")
    done = run_recipe(out, "+experiment=smoke", "logger.wandb.mode=disabled")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert (out / "checkpoints" / "step_2" / "COMPLETE").is_file()
    return out


def test_an_eval_of_step_2_gives_that_steps_validation_figures(smoke_run, tmp_path):
    out = tmp_path / "eval"
    # Validation's sampling: greedy, one episode per row; logged to an offline W&B run.
    sampling = ["eval.temperature=0", "eval.num_samples=1", "eval.pass_at_k=[1]"]
    wandb = ["eval.wandb=true", "logger.wandb.mode=offline"]
    done = run_eval(smoke_run, out, "+experiment=smoke", *sampling, *wandb)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["step"], summary["label"]) == (2, "step_2")
    assert summary["checkpoint"] == str(smoke_run / "checkpoints" / "step_2")
    (validated,) = [r for r in read_metrics(smoke_run) if r["step"] == 2]
    validation = {k[len("validation/") :]: v for k, v in validated.items() if "validation/" in k}
    evaluation = {k[len("eval/") :]: v for k, v in summary["metrics"].items()}
    assert len(validation) > 40  # every per-agent field of both agents
    assert {k: evaluation[k] for k in validation} == pytest.approx(validation)
    assert list((out / "wandb").glob("offline-run-*")), "no offline W&B run in the eval folder"


def test_the_checkpoint_is_evaluated_on_a_launched_gym_deployment(smoke_run, tmp_path):
    if not (ROOT / ".venv-gym" / "bin" / "ng_run").is_file():
        pytest.fail("NeMo-Gym's venv is missing: run `make gym-venv` first")
    out = tmp_path / "eval"
    done = run_eval(
        smoke_run,
        out,
        "+experiment=gym_example",
        "policy=tiny_llama",  # the smoke run's model: the checkpoint's weights fit it
        "env.data.val_jsonl=data/gym_example/train.jsonl",
        "generation.server.max_tokens_per_turn=24",
        "eval.num_samples=2",
        "eval.pass_at_k=[1,2]",
        timeout=1500,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["env_source"] == "gym_launch" and summary["step"] == 2
    rows = len((ROOT / "data" / "gym_example" / "train.jsonl").read_text().splitlines())
    episodes = (out / "episodes.jsonl").read_text().splitlines()
    assert len(episodes) == 2 * rows
    for agent in GYM_AGENTS:
        assert f"eval/{agent}/pass@2" in summary["metrics"]
    # Stock Gym agents report no finish reasons; the record says so rather than guessing.
    assert {json.loads(line)["finish_reasons"] for line in episodes} == {None}


def test_ctrl_c_keeps_what_finished_and_exits_130(smoke_run, tmp_path):
    out = tmp_path / "eval"
    many = ["+experiment=smoke", "env.data.num_builtin_val_rows_per_agent=16"]
    process = subprocess.Popen(
        eval_command(smoke_run, out, *many),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    episodes = out / "episodes.jsonl"
    try:
        deadline = time.monotonic() + 600
        while not (episodes.is_file() and episodes.read_text().strip()):
            assert process.poll() is None, process.stdout.read() if process.stdout else ""
            assert time.monotonic() < deadline, "no episode finished within 600 s"
            time.sleep(0.2)
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=180)
    finally:
        process.kill()
    assert process.returncode == 130, output[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["complete"], summary["stopped_by"]) == (False, "SIGINT")
    recorded = len(episodes.read_text().splitlines())
    metrics = summary["metrics"]
    assert recorded == metrics["eval/episodes"] + metrics["eval/failures"]
    assert 0 < recorded < 2 * 16 * 4  # stopped part-way

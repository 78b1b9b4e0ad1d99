"""`python recipes/eval.py` as a user runs it: bad input refused before any model loads, naming
the key and the fix; an eval of the tiny model (real Ray, the generation server and Gym shard
roles, the built-in agents) writing one record per episode and a summary whose every metric is
documented. A checkpoint of a training run, a Gym deployment and Ctrl-C are in
tests/recipes/test_eval_run.py (slow)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gymrl.run.checkpoint import TrainerState, capture_rng_state, save_checkpoint
from tests.support.lora_checkpoint import save_lora_checkpoint
from tests.support.metric_docs import documented_patterns

ROOT = Path(__file__).resolve().parents[2]
AGENTS = ("calculator_agent", "guess_number_agent")
SMALL = ["+experiment=smoke", "env.data.num_builtin_val_rows_per_agent=2"]
# Printed once the roles are up: a refusal must come before it (and before Ray starts).
SET_UP = "held-out rows x"


def run_eval(tmp_path: Path, *overrides: str, check_modules: bool = False):
    args = [*overrides, f"run.output_dir={tmp_path}", f"hydra.run.dir={tmp_path}"]
    if check_modules:
        code = (
            "import runpy, sys\n"
            f"sys.argv = ['recipes/eval.py', *{args!r}]\n"
            "try:\n    runpy.run_path('recipes/eval.py', run_name='__main__')\n"
            "finally:\n"
            "    print('HEAVY', sorted({'torch', 'ray', 'matplotlib'} & set(sys.modules)))\n"
        )
        command = [sys.executable, "-c", code]
    else:
        command = [sys.executable, "recipes/eval.py", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_too_few_samples_for_k_is_refused_before_torch_or_ray_is_imported(tmp_path):
    done = run_eval(tmp_path, *SMALL, "eval.num_samples=2", check_modules=True)
    assert done.returncode == 2
    assert "eval.num_samples = 2: pass@k needs at least k episodes per row" in done.stderr
    assert "raise eval.num_samples to 4" in done.stderr
    assert "HEAVY []" in done.stdout


def _checkpoint(root: Path, step: int) -> Path:
    model = torch.nn.Linear(2, 2)
    state = TrainerState(step, step, {"position": 0}, [capture_rng_state()])
    return save_checkpoint(root, model, torch.optim.AdamW(model.parameters()), state, keep_last=2)


def _damaged(tmp_path: Path) -> Path:
    folder = _checkpoint(tmp_path / "run" / "checkpoints", 2)
    (folder / "model.safetensors").write_bytes(b"cut")
    return folder


def _incomplete(tmp_path: Path) -> Path:
    folder = _checkpoint(tmp_path / "run" / "checkpoints", 2)
    (folder / "COMPLETE").unlink()
    return folder


def _unserved_rows(tmp_path: Path) -> Path:
    path = tmp_path / "val.jsonl"
    row = {"responses_create_params": {"input": "hi"}, "agent_ref": {"name": "nobody_agent"}}
    path.write_text(json.dumps(row) + "\n")
    return path


@pytest.mark.parametrize(
    ("make", "key", "says"),
    [
        (lambda tmp: tmp / "no_such_run", "eval.checkpoint", "does not exist"),
        (_incomplete, "eval.checkpoint", "not a complete checkpoint"),
        (_damaged, "eval.checkpoint", "fails its manifest: "),
        (_unserved_rows, "env.data.val_jsonl", "'nobody_agent' on line 1"),
    ],
    ids=["missing", "incomplete", "fails-manifest", "unserved-agent"],
)
def test_bad_input_is_refused_before_any_model_loads(tmp_path, make, key, says):
    path = make(tmp_path)
    done = run_eval(tmp_path / "out", *SMALL, f"{key}={path}")
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-3000:]
    assert f"{key}" in done.stderr and says in done.stderr
    assert SET_UP not in done.stdout
    assert not (tmp_path / "out" / "eval").exists()  # nothing written either


def test_an_eval_of_the_tiny_model_records_every_episode_and_a_documented_summary(tmp_path):
    overrides = [*SMALL, "eval.num_samples=2", "eval.pass_at_k=[1,2]"]
    done = run_eval(tmp_path, *overrides)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    folder = tmp_path / "eval" / "start"
    episodes = [json.loads(line) for line in (folder / "episodes.jsonl").read_text().splitlines()]
    assert len(episodes) == 2 * len(AGENTS) * 2  # rows x agents x samples
    assert {(e["agent"], e["sample"]) for e in episodes} == {(a, s) for a in AGENTS for s in (0, 1)}
    for episode in episodes:
        assert episode["failure"] is None
        assert episode["tokens"]["generated"] > 0 and episode["tokens"]["prompt"] > 0
        assert len(episode["finish_reasons"]) == episode["turns"] >= 1
        assert episode["truncated"] == bool(episode["truncation_causes"])
    summary = json.loads((folder / "summary.json").read_text())
    assert (summary["complete"], summary["step"], summary["label"]) == (True, 0, "start")
    assert (summary["rows"], summary["num_samples"], summary["pass_at_k"]) == (4, 2, [1, 2])
    assert summary["temperature"] == 1.0  # null: the policy's training temperature
    metrics = summary["metrics"]
    assert metrics["eval/episodes"] == len(episodes)
    for agent in AGENTS:
        for k in (1, 2):
            assert 0.0 <= metrics[f"eval/{agent}/pass@{k}"] <= 1.0
        assert metrics[f"eval/{agent}/failure_rate"] == 0.0
        generated = sum(e["tokens"]["generated"] for e in episodes if e["agent"] == agent)
        assert metrics[f"eval/{agent}/tokens/generated"] == generated
    patterns = documented_patterns()
    assert [key for key in metrics if not any(p.match(key) for p in patterns)] == []
    assert "pass@2" in done.stdout  # the table a person reads
    again = run_eval(tmp_path, *overrides)
    assert again.returncode == 1 and "already holds an eval" in again.stderr


def test_a_lora_checkpoint_is_evaluated_with_its_adapter_merged_by_the_engine(tmp_path):
    """The adapter alone is in the checkpoint; the engine merges it into the policy's base (the
    tiny model of the same seed) at the checkpoint's step, as a training refit does."""
    _, folder = save_lora_checkpoint(tmp_path / "run" / "checkpoints", SMALL, step=3)
    checkpoint = f"eval.checkpoint={tmp_path / 'run'}"
    done = run_eval(tmp_path, *SMALL, checkpoint, "eval.num_samples=1", "eval.pass_at_k=[1]")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert f"engines hold the weights of {folder} (version 3)" in done.stderr + done.stdout
    summary = json.loads((tmp_path / "eval" / "step_3" / "summary.json").read_text())
    assert (summary["complete"], summary["step"], summary["checkpoint"]) == (True, 3, str(folder))


def test_a_lora_checkpoint_is_refused_for_sglang_before_any_server_starts(tmp_path):
    _, folder = save_lora_checkpoint(tmp_path / "checkpoints", SMALL, step=1)
    done = run_eval(tmp_path / "out", "+experiment=sglang_cpu_smoke", f"eval.checkpoint={folder}")
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-3000:]
    assert "holds a LoRA adapter, which only the torch engine merges" in done.stderr
    assert "python -m gymrl.recipes.merge_adapter" in done.stderr and SET_UP not in done.stdout

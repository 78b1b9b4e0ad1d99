"""docs/environments.md, "Train on a Gym environment": every command of the section's `bash`
blocks, read from the page and run as written, so the page cannot drift from the recipe. Only
where a command would write into the checkout or run for long is it changed: the rows go to a
temporary folder, the run's folder is a temporary one (and so is every later path to it), the run
is cut to one step. Needs `.venv-gym` (`make gym-venv`) and several minutes: `slow`."""

import json
import os
import random
import re
import shlex
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "environments.md"
SECTION = "## Train on a Gym environment"
AGENT = "math_advanced_calculations_simple_agent"


def section_commands() -> list[str]:
    """The command lines of the section's ```bash blocks, in page order."""
    text = PAGE.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    section = text[start : end if end != -1 else len(text)]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.DOTALL)
    return [
        line.strip()
        for block in blocks
        for line in block.splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]


def test_the_section_holds_each_step_s_command():
    commands = section_commands()
    kinds = [
        "make gym-venv",
        "python data/learn_gym/make_rows.py",
        "dry_run=true",
        "python recipes/grpo.py +experiment=learn_gym grpo.num_steps",
        "jq ",
        "python -m gymrl.plot",
    ]
    positions = [next(i for i, c in enumerate(commands) if kind in c) for kind in kinds]
    assert positions == sorted(positions), commands


def _run(command: str, timeout: int) -> subprocess.CompletedProcess:
    # This checkout's code, whichever checkout the editable install points at.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        ["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_the_section_s_commands_run_as_written(tmp_path):
    if not (ROOT / ".venv-gym" / "bin" / "ng_run").is_file():
        pytest.fail("NeMo-Gym's venv is missing: run `make gym-venv` first")
    run_dir = tmp_path / "run"
    outputs, run_name = {}, None
    for command in section_commands():
        named_run = re.search(r"run\.name=(\S+)", command)
        if named_run:
            run_name = named_run.group(1)
        elif run_name:  # later commands read the run's folder
            command = command.replace(f"outputs/{run_name}", str(run_dir))
        if command.startswith("python data/learn_gym/make_rows.py"):
            command += f" --out-dir {shlex.quote(str(tmp_path / 'rows'))}"
        elif command.startswith("python recipes/grpo.py") and "dry_run=true" in command:
            command += f" hydra.run.dir={tmp_path / 'dry'}"
        elif command.startswith("python recipes/grpo.py"):
            # A port slice of its own: two Gym launches on one machine (the CI's other slow
            # tests) can race for the first free port of the default slice.
            low = random.randrange(30000, 60000, 1000)
            command += (
                f" grpo.num_steps=1 run.output_dir={run_dir} hydra.run.dir={run_dir}"
                f" logger.progress_bar=false 'env.gym.port_range=[{low},{low + 1000}]'"
            )
        elif command.startswith("python -m gymrl.plot"):
            command = re.sub(r"-o \S+", f"-o {tmp_path / 'run.png'}", command)
        done = _run(command, timeout=1500)
        assert done.returncode == 0, (command, done.stdout[-3000:], done.stderr[-5000:])
        outputs[command] = done.stdout
    # What each step is there to show.
    for name in ("train.jsonl", "val.jsonl"):
        written = (tmp_path / "rows" / name).read_bytes()
        assert written == (ROOT / "data" / "learn_gym" / name).read_bytes(), name
    (dry,) = [out for command, out in outputs.items() if "dry_run=true" in command]
    assert "dry run: config valid, nothing started" in dry
    assert "prompts   data/learn_gym/train.jsonl: 385 rows" in dry
    assert "prompts   data/learn_gym/val.jsonl: 128 rows" in dry
    assert "append-only" in dry and "less than one turn" not in dry
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert f"train/{AGENT}/reward/mean" in records[-1]
    (read,) = [out for command, out in outputs.items() if command.startswith("jq ")]
    assert json.loads(read.splitlines()[-1])["reward"] == records[-1][f"train/{AGENT}/reward/mean"]
    assert (tmp_path / "run.png").stat().st_size > 0
    assert (run_dir / "gym" / "default" / "gym.log").is_file()

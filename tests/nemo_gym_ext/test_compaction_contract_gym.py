"""The compacted episodes the postprocessor's tests read are NeMo-Gym's own output.

`tests/data/compaction/episodes.json` is what `make_episodes.py` writes by driving Gym's
`ContextCompactionSession` and `build_transport_response` in Gym's venv (`make gym-venv`; .ci/run
makes it before the slow suite, so this test is `slow`). Written again here, it must come out
the same bytes: the digests, segment numbers and boundary events the fast tests rely on are the
pinned Gym's, not a copy of this project's reading of them.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "compaction"
GYM_PYTHON = ROOT / ".venv-gym" / "bin" / "python"


@pytest.mark.slow
def test_the_committed_episodes_are_what_gym_writes(tmp_path):
    assert GYM_PYTHON.is_file(), "NeMo-Gym's venv is missing: make gym-venv"
    out = tmp_path / "episodes.json"
    subprocess.run(
        [str(GYM_PYTHON), str(DATA / "make_episodes.py"), "--out", str(out)],
        check=True,
        timeout=120,
    )
    assert out.read_bytes() == (DATA / "episodes.json").read_bytes()

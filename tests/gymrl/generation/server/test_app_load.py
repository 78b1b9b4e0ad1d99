"""256 concurrent loopback clients against the policy server with the torch engine (a tiny
model, one request each): every request answered once, to the right caller, well-formed.

The checks are `benchmarks/bench_policy_server_load.py`'s own, run by that script as a whole
(the server here, the clients in a process of their own), so the benchmark that produces the
load figures is the one tested here.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
BENCH = ROOT / "benchmarks" / "bench_policy_server_load.py"


def test_256_concurrent_clients_each_get_their_own_answer():
    # This checkout's packages, in the script and in its client process, whichever checkout the
    # environment's editable install points at.
    paths = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    options = ["--model", "tiny", "--clients", "256", "--duration-s", "0", "--max-tokens", "4"]
    result = subprocess.run(
        [sys.executable, BENCH, *options],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "requests 256, answered 256, failures 0, duplicate ids 0" in result.stdout, result.stdout
    tokens_per_s = re.search(r"([\d.]+) generated tokens/s", result.stdout)
    assert tokens_per_s is not None and float(tokens_per_s.group(1)) > 0, result.stdout

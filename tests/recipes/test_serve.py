"""recipes/serve.py: the configured policy served alone, announced, answering with its key, and
gone after SIGTERM."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_serve_answers_until_sigterm(tmp_path):
    key_file = tmp_path / "policy.key"
    key_file.write_text("per-run-key\n")
    process = subprocess.Popen(
        [
            sys.executable,
            "recipes/serve.py",
            "+experiment=smoke",
            f"run.output_dir={tmp_path}",
            f"generation.server.api_key_file={key_file}",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    announcement = tmp_path / "policy_server.json"
    try:
        deadline = time.monotonic() + 300
        while not announcement.exists():
            assert process.poll() is None, process.stdout.read() if process.stdout else ""
            assert time.monotonic() < deadline, "no announcement within 300 s"
            time.sleep(0.5)
        time.sleep(0.2)  # the file is written in one call after it is created
        served = json.loads(announcement.read_text())
        assert served["policy_api_key"] == "per-run-key"
        reply = httpx.post(
            f"{served['policy_base_url']}/chat/completions",
            headers={"Authorization": f"Bearer {served['policy_api_key']}"},
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["generation_token_ids"]
        # Longer than the room a decode batch reserves: the fused step's cache grows mid-reply.
        long = httpx.post(
            f"{served['policy_base_url']}/chat/completions",
            headers={"Authorization": f"Bearer {served['policy_api_key']}"},
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "seed": 1},
            timeout=120,
        )
        assert long.status_code == 200, long.text
        assert len(long.json()["choices"][0]["message"]["generation_token_ids"]) == 200
        health = httpx.get(served["policy_base_url"].removesuffix("/v1") + "/health", timeout=5)
        assert health.status_code == 200
    finally:
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output
    assert "per-run-key" not in output
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{served['policy_base_url']}/models", timeout=5)

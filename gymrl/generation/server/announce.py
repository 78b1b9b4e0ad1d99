"""Where the policy server listens, and how a Gym deployment learns to call it.

A Gym deployment someone else starts (env.source=gym_join, or Gym agents tried against a
checkpoint with recipes/serve.py) must be told the policy server's URL, bearer key and model
name: Gym's `policy_base_url`, `policy_api_key` and `policy_model_name`. The server announces
them in `policy_server.json` in the run directory, readable by its owner only because it holds
the key; the console shows the URL, the model name and the file's path, never the key.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from gymrl.config.schema.recipe import RecipeConfig
from nemo_gym_ext.gym_launch import PolicyEndpoint

ANNOUNCEMENT_FILENAME = "policy_server.json"


def policy_server_host(config: RecipeConfig) -> str:
    """`generation.server.host`, or loopback on one machine and every interface on a cluster
    (Gym agents on other nodes call the server there)."""
    host = config.generation.server.host
    if host is not None:
        return host
    return "127.0.0.1" if config.cluster.ray_address is None else "0.0.0.0"


def announce_policy_server(output_dir: Path, policy: PolicyEndpoint) -> Path:
    """Write `policy_server.json` (mode 0600, created so from the start) and print the URL, the
    model name and the file's path."""
    path = output_dir / ANNOUNCEMENT_FILENAME
    announcement = {
        "policy_base_url": policy.base_url,
        "policy_model_name": policy.model_name,
        "policy_api_key": policy.api_key,
    }
    path.unlink(missing_ok=True)  # a file left by an earlier run may have other permissions
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as file:
        json.dump(announcement, file, indent=2)
        file.write("\n")
    print(
        f"policy server (OpenAI base URL for Gym agents): {policy.base_url} "
        f"(model {policy.model_name!r}; "
        f"URL, model name and API key for a Gym deployment: {path})",
        flush=True,
    )
    return path

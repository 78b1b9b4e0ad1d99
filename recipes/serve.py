"""Serve the configured policy with its OpenAI-compatible policy server until stopped.

    python recipes/serve.py                                        # the embedded SmolLM2 model
    python recipes/serve.py policy.source=pretrained policy.path=outputs/x/checkpoints/step_6/hf
    python recipes/serve.py generation.server.port=8000            # a fixed port for Gym to call

The same config tree as recipes/grpo.py (only the policy, generation and cluster parts matter
here): a Gym deployment started by hand can be pointed at a checkpoint without training. The
server's URL, model name and key are announced in `<run dir>/policy_server.json` (docs/
environments.md). SIGINT or SIGTERM stops it.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from gymrl.config.compose import register_schema_defaults, to_plain_dict
from gymrl.preflight.validate import validate_config
from nemo_gym_ext.config_errors import ConfigError

register_schema_defaults()


@hydra.main(config_path="../conf", config_name="grpo", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        config = validate_config(to_plain_dict(cfg))
    except ConfigError as error:
        print(error, file=sys.stderr)
        sys.exit(2)
    output_dir = Path(config.run.output_dir or HydraConfig.get().runtime.output_dir).resolve()
    from gymrl.recipes.serving import serve_policy  # torch and ray: only once the config is valid

    serve_policy(config, output_dir, threading.Event())


if __name__ == "__main__":
    main()

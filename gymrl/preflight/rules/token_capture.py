"""Rules on `token_capture.*` (`gymrl.config.schema.token_capture`)."""

from __future__ import annotations

from gymrl.config.schema.recipe import RecipeConfig
from nemo_gym_ext.config_errors import ConfigIssue


def receipt_mode_not_implemented(config: RecipeConfig) -> list[ConfigIssue]:
    """The schema keeps the switch (a later receipt mode reads it), but nothing serves it yet."""
    if not config.token_capture.enabled:
        return []
    return [
        ConfigIssue(
            "token_capture.enabled",
            True,
            "receipt mode is not implemented: this recipe reads token ids from each Gym "
            "result's output items, not from a capture store",
            "set token_capture.enabled=false (Gym's own capture, "
            "env.nemo_gym.token_id_capture, rebuilds the output items instead)",
        )
    ]

"""`token_capture.*`: NeMo-RL's token-capture receipt mode, which this recipe refuses
(`gymrl.preflight.rules.token_capture`)."""

from __future__ import annotations

from pydantic import Field

from gymrl.config.schema.base import Strict


class TokenCaptureConfig(Strict):
    enabled: bool = Field(
        default=False,
        description="NeMo-RL's token-capture receipt mode: Gym returns capture receipts and the "
        "trainer fetches the tokens from the capture store. Not implemented here (token ids are "
        "read from each result's output items), so true is refused; it is also incompatible with "
        "env.nemo_gym.truncate_noncontiguous_episodes. Gym's own capture is "
        "env.nemo_gym.token_id_capture.",
    )

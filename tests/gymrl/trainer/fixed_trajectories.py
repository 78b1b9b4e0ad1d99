"""Trajectories with fixed ids for the trainer tests (imported by the test modules beside it)."""

from gymrl.algo.trajectory import Trajectory


def fixed_trajectory(prompt: int, generated: int, group: str = "g") -> Trajectory:
    """Ids 1..prompt+generated; the last `generated` are trainable, at log-probability -0.5."""
    tokens = list(range(1, prompt + generated + 1))
    return Trajectory(
        token_ids=tokens,
        loss_mask=[0] * prompt + [1] * generated,
        generation_logprobs=[0.0] * prompt + [-0.5] * generated,
        reward=1.0,
        agent="a",
        group_id=group,
        weight_version=0,
    )
